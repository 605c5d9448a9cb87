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


def test_output_paths_are_checked_before_the_timing(capsys, tmp_path):
    """A folder given as a file fails at once, not after the run; missing folders are made."""
    for flag in ("--json", "--csv", "--markdown", "--record"):
        cli_fails(capsys, ["bench", "--cases", "1", flag, str(tmp_path)], f"{flag}: {tmp_path} is a folder")
    cli_fails(capsys, ["profile", "--case", "1", "--out", __file__], "--out: cannot make the folder")
    cli_fails(capsys, ["profile", "--case", "1", "--out", ""], "--out: name a folder")


def test_models_bench_refuses_what_the_machine_cannot_run(capsys):
    if not torch.cuda.is_available():
        cli_fails(capsys, ["models-bench", "--device", "cuda", "--out", ""], "torch sees no CUDA device")
    cli_fails(capsys, ["models-bench", "--device", "cpu", "--models", "llama-3.1-8b", "--out", ""],
              "models llama-3.1-8b on the CPU")
    cli_fails(capsys, ["models-bench", "--device", "tpu"], "invalid choice: 'tpu'")


def test_cold_cache_is_accepted_and_is_the_default(capsys):
    from flashdecode import cli

    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).warm_cache is False
    assert parser.parse_args(["bench", "--cold-cache"]).warm_cache is False
    assert parser.parse_args(["bench", "--warm-cache"]).warm_cache is True
    cli_fails(capsys, ["bench", "--cold-cache", "--warm-cache"], "not allowed with argument")


def test_candidates_ranks_the_log_and_flags_a_stagnating_case(capsys, tmp_path):
    from flashdecode import cli

    log = tmp_path / "candidates.jsonl"
    rows = [(10, "a", 0.020), (10, "b", 0.016), (10, "a", 0.0161), (10, "b", 0.0162), (10, "a", 0.0165), (3, "a", 0.006)]
    log.write_text("".join(json.dumps({"case": case, "device": "H200", "timestamp": f"2026-12-0{day}T00:00:00",
                                       "technique": technique, "validation": "pass", "runtime_ms": runtime,
                                       "speedup": None, "git_commit": None}) + "\n"
                           for day, (case, technique, runtime) in enumerate(rows, start=1)))
    assert cli.main(["candidates", "--file", str(log)]) == 0
    out = capsys.readouterr().out
    assert "case 10 on H200: 5 passing candidates, 0 failed, 2 techniques" in out
    assert out.index("16.00 us") < out.index("16.10 us") and "case 3 on H200" in out
    assert out.count("STAGNATING") == 1 and "flashdecode profile --case 10" in out
    assert cli.main(["candidates", "--file", str(log), "--case", "3"]) == 0
    assert "case 10" not in capsys.readouterr().out
    cli_fails(capsys, ["candidates", "--file", str(log), "--case", "W1"], "--case: no candidate of W1")
    cli_fails(capsys, ["candidates", "--file", str(tmp_path / "none.jsonl")], "--file: cannot read")
    for text, message in (('{"a": 1}\n', "line 1 is not a candidate record (missing: ['case'"),
                          ("[1, 2]\n", "line 1 is not a candidate record"), ("\n", "no candidates in")):
        (tmp_path / "odd.jsonl").write_text(text)
        cli_fails(capsys, ["candidates", "--file", str(tmp_path / "odd.jsonl")], message)


def test_candidates_from_runs_without_a_record_leaves_the_log(capsys, tmp_path):
    """A rebuild that read no bench run (the wrong file) refuses and leaves the log as it was."""
    log, other = tmp_path / "log.jsonl", tmp_path / "other.json"
    log.write_text("kept\n")
    other.write_text("{}")
    cli_fails(capsys, ["candidates", "--file", str(log), "--from-runs", str(other)], "--from-runs: no record in")
    assert log.read_text() == "kept\n"


def test_candidates_rebuilds_the_log_from_the_committed_runs(capsys, tmp_path):
    """docs/benchmarks.json gives one record per case and backend, with the plan's technique."""
    from flashdecode import cli

    log = tmp_path / "log.jsonl"
    assert cli.main(["candidates", "--file", str(log), "--from-runs", str(REPO / "docs" / "benchmarks.json")]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {record["case"] for record in records} == set(range(1, 15))
    assert {record["backend"] for record in records} == {"tilelang", "triton"}
    assert all(record["technique"].startswith(f"{record['backend']} {record['config']['kernel']}(")
               for record in records)
    assert "wrote 28 records" in capsys.readouterr().err
# --- flashdecode warmup -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["warmup", "--cases", "15"], "unknown case 15"),
    (["warmup", "--variant", "paged32"], "unknown variants ['paged32']"),
    (["warmup", "--variant", ""], "--variant: name at least one variant"),
    (["warmup", "--splits", "2,x"], "must be a comma list of integers >= 0"),
    (["warmup", "--block-n", "-64"], "must be a comma list of integers >= 0"),
    (["warmup", "--shard", "2/2"], "--shard must be I/N with 0 <= I < N"),
    (["warmup", "--shard", "1"], "--shard must be I/N with 0 <= I < N"),
    (["warmup", "--block-n", "7"], "--block-n: config.block_n must be a power of two >= 16, got 7"),
    (["warmup", "--q-rows", "3"], "--q-rows: config.block_m must be a power of two >= 16, got 3"),
    (["warmup", "--stages", "0"], "--stages: config.num_stages must be >= 1, got 0"),
    (["warmup", "--cache-dir", __file__], "is a file; name a folder"),
])
def test_warmup_argument_errors_exit_nonzero(capsys, argv, message):
    cli_fails(capsys, argv, message)


def test_warmup_lists_each_kernel_once():
    """Case 5 (3 tiles: the short-cache kernel unforced, the split kernel and its combine forced
    into 2 or 3 splits) and on pages of 1 (which TileLang does not take): the plain case's kernels
    once each, whatever the splits; tile variants multiply the split kernel's."""
    pytest.importorskip("tilelang")
    from flashdecode.cases import CASES_BY_NUMBER, VARIANTS
    from flashdecode.kernels.tilelang import warmup

    problems = [VARIANTS["plain"].problem(CASES_BY_NUMBER[5]), VARIANTS["paged1"].problem(CASES_BY_NUMBER[5])]
    entries = warmup.kernels([(problem, splits) for problem in problems for splits in warmup.DEFAULT_SPLITS])
    assert [kernel for kernel, _, _ in entries] == ["short_cache", "split", "combine"]
    assert all(problem == problems[0] for _, problem, _ in entries)
    variants = warmup.tile_variants(block_n=(32, 64), num_stages=(2, 3), block_m=())
    assert variants == [dict(block_n=32, num_stages=2), dict(block_n=32, num_stages=3),
                        dict(block_n=64, num_stages=2), dict(block_n=64, num_stages=3)]
    split = [config for kernel, _, config in warmup.kernels([(problems[0], 2)], variants) if kernel == "split"]
    assert [(config.block_n, config.num_stages) for config in split] == [(32, 2), (32, 3), (64, 2), (64, 3)]
    with pytest.raises(ValueError, match="tile fields must be among"):
        warmup.tile_variants(warps=(4,))
    with pytest.raises(ValueError, match="shard must be"):
        warmup.build(entries, shard=(1, 1))


@pytest.mark.slow
def test_warmup_builds_a_tiny_case_into_the_given_cache(tmp_path):
    """`flashdecode warmup` on one shape of one tile: one kernel compiled for sm_90a without a GPU,
    into the folder --cache-dir names."""
    pytest.importorskip("tilelang")
    from flashdecode.kernels.tilelang.backend import TileLangBackend

    if TileLangBackend().unavailable() is not None:
        pytest.skip(f"building TileLang's kernels needs {TileLangBackend().unavailable()}")
    done = subprocess.run([sys.executable, "-m", "flashdecode", "warmup", "--shapes", "1x32x1x1x64:uniform",
                           "--variant", "plain", "--splits", "0", "--cache-dir", str(tmp_path / "cache")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"1 of 1 kernels built into {tmp_path / 'cache'}" in done.stdout
    assert any(path.is_file() for path in (tmp_path / "cache").rglob("*"))


# --- tools/ ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["fp8_sass.py", "--cases", "W3"], "--cases: invalid case list 'W3'"),
    (["fp8_sass.py", "--field", "fp8_v_words"], "--field, --values: a TritonConfig field and its integer values"),
    (["triton_ptx.py", __file__], "is a file; name a folder"),
    (["warmup_tests.py", "--shard", "5/2"], "--shard must be I/N with 0 <= I < N"),
])
def test_tools_refuse_bad_arguments_by_name(argv, message):
    """The tools' bad arguments end in argparse's error (exit 2), not a traceback after work."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / argv[0]), *argv[1:]], capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_device_script_prints_its_usage():
    result = subprocess.run(["bash", str(REPO / "tools" / "device.sh"), "--help"], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0 and "Steps:" in result.stdout and "tar" not in result.stderr
