"""One rank of the tensor-parallel check (``test_transformers_tp.py``): loads MODEL_DIR with
``tp_plan="auto"`` when launched by torchrun with several processes (gloo on CPU), decodes the
prompts in PROMPTS_PATH through flashdecode, and (rank 0) saves the step logits to OUT_PATH.

    torchrun --nproc_per_node 2 tests/transformers_tp_worker.py MODEL_DIR PROMPTS_PATH OUT_PATH [BACKEND]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from test_transformers import step_logits  # noqa: E402

from flashdecode.integrations import transformers as fd_transformers  # noqa: E402


def main(model_dir, prompts_path, out_path, backend="reference"):
    from transformers import AttentionInterface, AutoModelForCausalLM

    name = fd_transformers.register(backend)
    attention, heads = AttentionInterface._global_mapping[name], set()

    def recording(module, query, *args, **kwargs):
        heads.add(query.shape[1])
        return attention(module, query, *args, **kwargs)

    AttentionInterface.register(name, recording)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, tp_plan="auto" if world > 1 else None,
                                                 attn_implementation=name).eval()
    ids, mask, tokens = torch.load(prompts_path)
    logits = step_logits(model, ids, mask, tokens, "dynamic")
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"logits": logits, "local_heads": sorted(heads), "world": world}, out_path)
    if torch.distributed.is_initialized():  # torn down here: left to exit, gloo's threads once aborted rank 0
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
