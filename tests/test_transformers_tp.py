"""Tensor parallel decode through flashdecode: transformers' ``tp_plan="auto"`` over 2 CPU processes
(torchrun, gloo) gives the logits of one process within bf16 rounding, each rank's heads going
through flashdecode (``transformers_tp_worker.py``)."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it for tp_plan

from test_transformers import greedy_tokens, padded_prompts, tiny_model  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "transformers_tp_worker.py")


def run_worker(processes, model_dir, prompts_path, out_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "--master_port", str(29500 + os.getpid() % 1000 + processes), WORKER, str(model_dir),
               str(prompts_path), str(out_path)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out_path)


@pytest.mark.slow
def test_two_processes_give_the_logits_of_one(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    ids, mask = padded_prompts(256)
    torch.save((ids, mask, greedy_tokens(model, ids, mask, 6)), tmp_path / "prompts.pt")
    one = run_worker(1, tmp_path / "model", tmp_path / "prompts.pt", tmp_path / "one.pt")
    two = run_worker(2, tmp_path / "model", tmp_path / "prompts.pt", tmp_path / "two.pt")
    assert two["world"] == 2 and two["local_heads"] == [one["local_heads"][0] // 2]  # each rank: half the heads
    distance = (two["logits"] - one["logits"]).flatten(1).norm(dim=1) / one["logits"].flatten(1).norm(dim=1)
    assert distance.max() < 2e-2, distance  # bf16 rounding: the all-reduce sums in another order
    assert (two["logits"].argmax(-1) == one["logits"].argmax(-1)).float().mean() >= 0.9
