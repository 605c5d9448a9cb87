"""The ``flashdecode`` command: argument parsing, errors, and one end-to-end CPU run."""
from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import cli_fails
from flashdecode import cli
from flashdecode.bench import peers, report

REPO = pathlib.Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("text, expected", [
    ("1,3,7-9", (1, 3, 7, 8, 9)), ("10", (10,)), (" 2 , 2,1 ", (2, 1)), ("13-14", (13, 14)),
    ("all", tuple(range(1, 15))),
])
def test_parse_cases(text, expected):
    assert cli.parse_cases(text) == expected


@pytest.mark.parametrize("text", ["0", "15", "x", "3-1", "", "1,", "1-x", "-3"])
def test_parse_cases_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_cases(text)


@pytest.fixture
def interpret(monkeypatch):
    """main() sets TRITON_INTERPRET without CUDA; set it here so it is undone after the test."""
    if NO_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--cases", "0"], "unknown case 0"),
    (["bench", "--cases", "15"], "unknown case 15"),
    (["bench", "--cases", "x"], "invalid case list"),
    (["bench", "--iters", "0"], "positive integer"),
    (["bench", "--bogus"], "unrecognized arguments"),
    ([], "required"),
])
def test_argument_errors_exit_nonzero(capsys, argv, message):
    cli_fails(capsys, argv, message)


def test_unknown_peer_and_backend(capsys, interpret):
    cli_fails(capsys, ["bench", "--peers", "nope"], "unknown peer 'nope'")
    cli_fails(capsys, ["bench", "--backends", "cuda"], "unknown backends ['cuda']")


@pytest.mark.skipif(not NO_CUDA, reason="checks the errors of a machine without CUDA")
def test_gpu_only_requests_fail_without_cuda(capsys, interpret):
    cli_fails(capsys, ["bench", "--backends", "tilelang"], "backend 'tilelang' needs a CUDA device")
    cli_fails(capsys, ["bench", "--peers", "flex"], "peer 'flex' cannot run here: needs a CUDA device")


def test_named_peer_that_does_not_import_is_an_error(capsys, interpret, monkeypatch):
    def missing():
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setitem(peers.PEERS, "sdpa", peers.PEERS["sdpa"].__class__(
        "sdpa", "stand-in", False, missing, None))
    cli_fails(capsys, ["bench", "--peers", "sdpa"], "peer 'sdpa' cannot run here: No module named 'flash_attn'")


def test_end_to_end_cpu_run(tmp_path):
    """The documented command in a child process, on a temporary folder; every output is written."""
    paths = {name: tmp_path / name for name in ("run.json", "run.csv", "bw.png", "log/candidates.jsonl")}
    command = [sys.executable, "-m", "flashdecode", "bench", "--cases", "1,2", "--json", paths["run.json"],
               "--csv", paths["run.csv"], "--plot", paths["bw.png"], "--record", paths["log/candidates.jsonl"],
               "--machine"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(part) for part in command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    machine = [report.parse_machine_line(line) for line in done.stdout.splitlines() if line.startswith("CASE:")]
    assert [(fields["case"], fields["backend"]) for fields in machine] == [(1, "triton"), (2, "triton")]
    assert all(fields["compiled"] and fields["correct"] and fields["speedup"] > 0 for fields in machine)
    if NO_CUDA:
        assert "CPU TIMINGS" in done.stdout and "not comparable" in done.stdout

    data = json.loads(paths["run.json"].read_text())
    assert [c["case"] for c in data["cases"]] == [1, 2]
    assert data["cases"][0]["results"]["triton"]["plan"]["block_n"] > 0
    assert data["ceiling"]["gbps"] > 0 and data["versions"]["torch"] == torch.__version__
    rows = list(csv.DictReader(paths["run.csv"].open()))
    assert {row["system"] for row in rows} >= {"triton"} and {row["case"] for row in rows} == {"1", "2"}
    assert paths["bw.png"].read_bytes()[:4] == b"\x89PNG"
    records = [json.loads(line) for line in paths["log/candidates.jsonl"].read_text().splitlines()]
    assert [(r["case"], r["backend"], r["validation"]) for r in records] == [
        (1, "triton", "pass"), (2, "triton", "pass")]
