"""The ``flashdecode`` command: argument parsing, errors, and end-to-end CPU runs."""
from __future__ import annotations

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import cli_fails
from flashdecode.bench import peers, report

REPO = pathlib.Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def interpret(monkeypatch):
    """main() sets TRITON_INTERPRET without CUDA; set it here so it is undone after the test."""
    if NO_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--cases", "0"], "--cases: unknown case 0"),
    (["bench", "--cases", "15"], "unknown case 15 in '15': matrix 'cases' has cases 1-14"),
    (["bench", "--cases", "x"], "invalid case list"),
    (["bench", "--cases", "W1"], "matrix 'cases' takes labels and ranges like 1,3,7-9"),
    (["bench", "--matrix", "wide", "--cases", "3"], "matrix 'wide' takes labels and ranges like W1,W3-W5"),
    (["bench", "--matrix", "wide", "--cases", "W15"], "unknown case W15"),
    (["bench", "--matrix", "tall"], "invalid choice: 'tall'"),
    (["bench", "--iters", "0"], "positive integer"),
    (["bench", "--shapes", "16x2048x1x71:uniform"], "--shapes: each shape is batch x seqlen_cache"),
    (["bench", "--no-record"], "unrecognized arguments"),
    (["bench", "--bogus"], "unrecognized arguments"),
    ([], "required"),
])
def test_argument_errors_exit_nonzero(capsys, argv, message):
    cli_fails(capsys, argv, message)


def test_unknown_peer_backend_and_variant(capsys, interpret):
    cli_fails(capsys, ["bench", "--peers", "nope"], "unknown peer 'nope'")
    cli_fails(capsys, ["bench", "--backends", "cuda"], "unknown backends ['cuda']")
    cli_fails(capsys, ["bench", "--variant", "plain,paged32"],
              "unknown variants ['paged32']; variants are plain, paged1, paged4, paged16, paged64, paged256, "
              "paged16-ordered, paged64-ordered, q4, append")


@pytest.mark.skipif(not NO_CUDA, reason="checks the errors of a machine without CUDA")
def test_gpu_only_requests_fail_without_cuda(capsys, interpret):
    cli_fails(capsys, ["bench", "--backends", "tilelang"], "backend 'tilelang' cannot take this call")
    for name in ("flex", "fa2", "flashinfer-tc", "flashinfer-single"):
        cli_fails(capsys, ["bench", "--peers", name], f"peer '{name}' cannot run here: needs a CUDA device")


def test_named_peer_that_does_not_import_is_an_error(capsys, interpret, monkeypatch):
    def missing():
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setitem(peers.PEERS, "sdpa", peers.PEERS["sdpa"].__class__(
        "sdpa", "stand-in", False, missing, None, None))
    cli_fails(capsys, ["bench", "--peers", "sdpa"], "peer 'sdpa' cannot run here: No module named 'flash_attn'")


def _bench(tmp_path, *args):
    """`python -m flashdecode bench ARGS` in a child process run in ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "flashdecode", "bench", *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # two cases benchmarked end to end under the interpreter
def test_end_to_end_cpu_run(tmp_path):
    """The documented command on a temporary folder; every output is written, the record only where named."""
    paths = {name: tmp_path / name for name in ("run.json", "run.csv", "bw.png", "log/candidates.jsonl")}
    stdout = _bench(tmp_path, "--cases", "1,2", "--json", paths["run.json"], "--csv", paths["run.csv"],
                    "--plot", paths["bw.png"], "--record", paths["log/candidates.jsonl"], "--machine")
    machine = [report.parse_machine_line(line) for line in stdout.splitlines() if line.startswith("CASE:")]
    assert [(fields["case"], fields["backend"]) for fields in machine] == [(1, "triton"), (2, "triton")]
    assert all(fields["compiled"] and fields["correct"] and fields["speedup"] > 0 for fields in machine)
    assert "plain torch launch (q.add_(0))" in stdout and "eager us" in stdout
    if NO_CUDA:
        assert "CPU TIMINGS" in stdout and "not comparable" in stdout

    data = json.loads(paths["run.json"].read_text())
    assert [(c["case"], c["variant"]) for c in data["cases"]] == [("1", "plain"), ("2", "plain")]
    triton = data["cases"][0]["results"]["triton"]
    assert triton["plan"]["config"]["block_n"] > 0 and triton["host_overhead_us"] > 0 and triton["eager_layers"] >= 1
    assert data["ceiling"]["gbps"] > 0 and data["versions"]["torch"] == torch.__version__
    assert data["settings"]["torch_launch_us"] > 0
    rows = list(csv.DictReader(paths["run.csv"].open()))
    assert {row["system"] for row in rows} >= {"triton"} and {row["case"] for row in rows} == {"1", "2"}
    assert paths["bw.png"].read_bytes()[:4] == b"\x89PNG"
    records = [json.loads(line) for line in paths["log/candidates.jsonl"].read_text().splitlines()]
    assert [(r["case"], r["backend"], r["validation"]) for r in records] == [
        (1, "triton", "pass"), (2, "triton", "pass")]
    assert not (tmp_path / "results").exists()  # no default record file


@pytest.mark.slow
def test_end_to_end_variants_and_wide_matrix(tmp_path):
    """Every variant on a case off the block boundaries, and a wide-matrix case: checked against the
    reference, with the peers that cannot take a variant skipped, not failed."""
    stdout = _bench(tmp_path, "--cases", "3", "--variant", "plain,paged16,paged64,paged256,q4,append", "--backends",
                    "triton", "--peers", "sdpa", "--json", tmp_path / "variants.json", "--machine")
    data = json.loads((tmp_path / "variants.json").read_text())
    assert [c["variant"] for c in data["cases"]] == ["plain", "paged16", "paged64", "paged256", "q4", "append"]
    for case in data["cases"]:
        assert case["results"]["triton"]["correct"], case
        sdpa = case["results"]["sdpa"]
        assert sdpa["correct"] if case["variant"] == "plain" else sdpa["skipped"] == \
            "plain decode only (no pages, seqlen_q 1, no append)"
    machine = [report.parse_machine_line(line)["case"] for line in stdout.splitlines() if line.startswith("CASE:")]
    assert machine == [3, "3/paged16", "3/paged64", "3/paged256", "3/q4", "3/append"]
    assert data["cases"][5]["bytes"] > data["cases"][0]["bytes"]  # the appended rows

    stdout = _bench(tmp_path, "--matrix", "wide", "--cases", "W13", "--backends", "triton", "--peers", "none",
                    "--json", tmp_path / "wide.json")
    wide = json.loads((tmp_path / "wide.json").read_text())["cases"][0]
    assert (wide["case"], wide["matrix"], wide["matrix_shape"]["batch"]) == ("W13", "wide", 128)
    assert wide["results"]["triton"]["correct"] and "W13 plain" in stdout

    stdout = _bench(tmp_path, "--shapes", "2x40x1x3x64:uniform", "--backends", "triton", "--peers", "none",
                    "--json", tmp_path / "shapes.json")
    own = json.loads((tmp_path / "shapes.json").read_text())["cases"]
    assert [(case["case"], case["matrix"]) for case in own] == [("S1", "shapes")]
    assert own[0]["results"]["triton"]["correct"] and "S1 plain" in stdout
