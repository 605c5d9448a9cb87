"""The benchmark's parts on CPU: statistics, machine lines, writers, plot, case matrix vs the anchor file."""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from flashdecode import cases
from flashdecode.bench import report
from flashdecode.bench.results import BenchRun, CaseRun, Ceiling, Result, System
from flashdecode.bench.timing import Timer, Timing, summarize

REPO = pathlib.Path(__file__).resolve().parents[1]
ANCHOR = json.loads((REPO / "flashdecode" / "data" / "h200-peers.json").read_text())
SPEC_LINE = ("CASE:10 COMPILED:True CORRECT:True BACKEND:tilelang RUNTIME:0.0623 REF_RUNTIME:0.0618 "
             "SPEEDUP:0.9912x BW_GBPS:2710 BW_FRACTION:0.60")


# --- statistics and the timer -------------------------------------------------------------------

def test_summarize_known_lists():
    assert summarize([5.0, 1.0, 4.0, 2.0, 3.0]) == Timing(median_us=3.0, min_us=1.0, p80_us=4.2, runs=5)
    assert summarize([7.0]) == Timing(7.0, 7.0, 7.0, 1)
    even = summarize([1.0, 2.0, 3.0, 10.0])
    assert (even.median_us, even.min_us) == (2.5, 1.0)
    assert even.p80_us == pytest.approx(3.0 + 0.4 * 7.0)  # index 0.8 * 3 = 2.4 between 3 and 10
    with pytest.raises(ValueError):
        summarize([])


def test_cpu_timer_runs_warmup_plus_iters_and_has_no_graph():
    calls = []
    timer = Timer(torch.device("cpu"), iters=5, warmup=2)
    timing = timer.time(lambda: calls.append(1))
    assert len(calls) == 7 and timing.runs == 5 and 0 <= timing.min_us <= timing.median_us <= timing.p80_us
    assert timer.flush_bytes == 0 and timer.time_graph(lambda: None) is None
    assert timer.host_overhead_us(lambda: calls.append(1), calls=10) > 0 and len(calls) == 17
    with pytest.raises(ValueError):
        Timer(torch.device("cpu"), iters=0, warmup=0)


# --- machine lines ------------------------------------------------------------------------------

def test_machine_line_spec_example_round_trips():
    fields = report.parse_machine_line(SPEC_LINE)
    assert fields == {"case": 10, "compiled": True, "correct": True, "backend": "tilelang", "runtime": 0.0623,
                      "ref_runtime": 0.0618, "speedup": 0.9912, "bw_gbps": 2710, "bw_fraction": 0.60}
    assert report.format_machine_line(fields) == SPEC_LINE


def test_machine_lines_of_a_run_parse_back(fake_run):
    lines = report.machine_lines(fake_run)
    assert len(lines) == 2  # our backend on both cases; peers get no machine line
    good, failed = (report.parse_machine_line(line) for line in lines)
    assert good == report.machine_fields(fake_run.cases[0], fake_run.cases[0].results[0])
    assert good["runtime"] == 0.0123 and good["speedup"] == round(8.06 / 12.3456, 4)
    assert good["bw_gbps"] == 1  # 18432 bytes in 12.3 us
    assert failed["correct"] is False and failed["speedup"] is None and failed["runtime"] == 0.05
    assert "SPEEDUP:n/a" in lines[1] and "CORRECT:False" in lines[1]


def test_parse_machine_line_rejects_garbage():
    with pytest.raises(ValueError):
        report.parse_machine_line("CASE:1 FOO:2")
    with pytest.raises(ValueError):
        report.parse_machine_line("CASE:1 BACKEND:triton")


# --- writers ------------------------------------------------------------------------------------

def _result(system, kind, median, correct=True, speedup=None, error=None):
    timing = Timing(median, median * 0.9, median * 1.1, 100)
    return Result(system, kind, compiled=True, correct=correct, rel_err=1e-3 if correct else float("nan"),
                  fresh_rel_err=1e-3, timing=timing, graph=Timing(median / 2, median / 2, median / 2, 100),
                  host_overhead_us=9.5 if kind == "ours" else None, bandwidth_gbps=18432 / median / 1e3,
                  fraction=0.5, speedup=speedup,
                  plan={"block_n": 64, "programs_per_head": 1, "forced_splits": 0, "can_split": False}
                  if kind == "ours" else None, error=error)


@pytest.fixture
def fake_run():
    case1, case2 = cases.CASES_BY_NUMBER[1], cases.CASES_BY_NUMBER[2]
    ours = System("triton", "ours", "flashdecode 0.1.0", "flash_decode_with_kvcache", None)
    peer = System("sdpa", "peer", "torch 2.11", "torch SDPA", None)
    return BenchRun(
        environment={"device": "Fake GPU", "cuda": True, "versions": {"torch": "2.11"}, "git_commit": "abc",
                     "date": "2026-11-29T00:00:00+00:00"},
        settings={"iters": 100},
        ceiling=Ceiling("fake read", 2 ** 31, 500.0, 4295.0),
        systems=[ours, peer], skipped=["fa2: not installed"], notes=["baseline from the file"],
        cases=[
            CaseRun(case1, case1, 18432, 8.06, "fa2 from the file", None,
                    [_result("triton", "ours", 12.3456, speedup=8.06 / 12.3456), _result("sdpa", "peer", 300.0)]),
            CaseRun(case2, case2, 94208, 8.8, "fa2 from the file", None,
                    [_result("triton", "ours", 50.0, correct=False), _result("sdpa", "peer", 40.0, error="boom")]),
        ])


def test_json_has_the_whole_run(fake_run, tmp_path):
    path = tmp_path / "run.json"
    report.write_json(fake_run, path)
    data = json.loads(path.read_text())
    assert data["device"] == "Fake GPU" and data["git_commit"] == "abc" and data["ceiling"]["gbps"] == 4295.0
    first = data["cases"][0]
    assert first["case"] == 1 and first["bytes"] == 18432 and first["baseline_us"] == 8.06
    triton = first["results"]["triton"]
    assert triton["median_us"] == 12.3456 and triton["graph_us"] == 12.3456 / 2 and triton["host_overhead_us"] == 9.5
    assert triton["plan"]["block_n"] == 64 and "plan" not in first["results"]["sdpa"]
    assert data["cases"][1]["results"]["triton"]["rel_err"] == "nan"  # JSON has no NaN


def test_csv_has_a_row_per_case_and_system(fake_run, tmp_path):
    path = tmp_path / "run.csv"
    report.write_csv(fake_run, path)
    rows = list(csv.DictReader(path.open()))
    assert [(row["case"], row["system"]) for row in rows] == [
        ("1", "triton"), ("1", "sdpa"), ("2", "triton"), ("2", "sdpa")]
    assert float(rows[0]["median_us"]) == 12.3456 and rows[3]["error"] == "boom" and rows[2]["correct"] == "False"


def test_plot_is_a_png(fake_run, tmp_path):
    path = tmp_path / "bw.png"
    report.write_plot(fake_run, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_records_append_and_keep_earlier_lines(fake_run, tmp_path):
    path = tmp_path / "results" / "candidates.jsonl"
    report.append_records(fake_run, path)
    first = path.read_text()
    report.append_records(fake_run, path)
    text = path.read_text()
    assert text.startswith(first) and len(text.splitlines()) == 4
    records = [json.loads(line) for line in text.splitlines()]
    assert len({record["id"] for record in records}) == 4
    good, failed = records[:2]
    assert good["validation"] == "pass" and failed["validation"] == "fail" and failed["speedup"] is None
    assert good["runtime_ms"] == pytest.approx(0.0123456) and good["ref_runtime_ms"] == pytest.approx(0.00806)
    assert good["technique"] == "split-kv gqa-packed triton" and good["config"]["block_n"] == 64
    assert good["device"] == "Fake GPU" and good["git_commit"] == "abc" and good["case"] == 1


def test_table_shows_every_result_and_the_file_baseline(fake_run):
    table = report.format_table(fake_run)
    assert "12.35" in table and "FAIL" in table and "fa2 (file)" in table and "case 2 sdpa: boom" in table
    assert "skipped: fa2: not installed" in table and "note: baseline from the file" in table
    assert "system sdpa [torch 2.11]: torch SDPA" in table


def test_progress_counter_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes "from tqdm import tqdm" fail
    stream = io.StringIO()
    progress = report.Progress(2, stream)
    progress.advance("ceiling")
    progress.advance("case 1 triton")
    progress.close()
    assert stream.getvalue() == "[1/2] ceiling\n[2/2] case 1 triton\n"


# --- the case matrix reproduces the anchor's inputs ------------------------------------------------

@pytest.mark.parametrize("row", ANCHOR["cases"], ids=lambda row: f"case{row['case']}")
def test_case_matrix_matches_the_anchor_file(row):
    case = cases.CASES_BY_NUMBER[row["case"]]
    assert (case.batch, case.seqlen_cache, case.nheads_k, case.group) == (
        row["batch"], row["seqK"], row["n_kv_heads"], row["gqa_group"])
    lengths = cases.case_seqlens(case.batch, case.seqlen_cache).tolist()
    assert cases.bytes_read(lengths, case.nheads_k, case.nheads) == row["bytes"]


def test_anchor_file_covers_all_cases():
    assert [row["case"] for row in ANCHOR["cases"]] == [case.number for case in cases.CASES]
    assert all(math.isfinite(row["fa2"]["median_us"]) for row in ANCHOR["cases"])


# --- the ceiling kernel ---------------------------------------------------------------------------

def test_stream_read_kernel_sums_its_buffer_under_the_interpreter():
    """Run in a child process: TRITON_INTERPRET must be set before the kernel is defined."""
    script = (
        "import torch\n"
        "from flashdecode.bench.ceiling import READ_BLOCK, READ_TILES, stream_read\n"
        "src = torch.arange(3 * READ_BLOCK * READ_TILES, dtype=torch.float32).remainder(7).to(torch.float16)\n"
        "sums = stream_read(src, torch.empty(3))\n"
        "assert torch.allclose(sums, src.float().view(3, -1).sum(1)), sums\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


# --- runner pieces (the runner imports Triton: interpreter mode without CUDA) ---------------------

@pytest.fixture
def runner(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from flashdecode.bench import runner

    return runner


def test_relative_error(runner):
    reference = torch.ones(2, 1, 4, 8)
    assert runner.relative_error(reference.half(), reference) == 0.0
    assert runner.relative_error(reference * 1.01, reference) == pytest.approx(0.01, rel=1e-4)
    assert math.isnan(runner.relative_error(torch.full_like(reference, float("nan")), reference))
    with pytest.raises(ValueError):
        runner.relative_error(reference[:, 0], reference)


def test_baseline_is_fa2_of_this_run_else_the_anchor_file(runner):
    case = cases.CASES_BY_NUMBER[10]
    anchor = ANCHOR
    ours = _result("triton", "ours", 20.0)
    assert runner._baseline(case, [ours, _result("fa2", "peer", 15.0)], True, anchor) == (
        15.0, "fa2 timed in this run", "fa2")
    us, source, system = runner._baseline(case, [ours], True, anchor)
    assert us == ANCHOR["cases"][9]["fa2"]["median_us"] and "h200-peers.json" in source and system is None
    assert runner._baseline(case, [ours, _result("reference", "reference", 5.0)], False, anchor)[::2] == (
        5.0, "reference")


def test_measure_checks_outputs_and_survives_failures(runner):
    case = dataclasses.replace(cases.CASES_BY_NUMBER[3], batch=2, seqlen_cache=8)
    inputs = cases.make_inputs(case, dtype=torch.float16)
    fresh = cases.make_inputs(case, dtype=torch.float16, seed=runner.FRESH_SEED)
    references = runner.reference_decode(*inputs)[0], runner.reference_decode(*fresh)[0]
    timer = Timer(torch.device("cpu"), iters=2, warmup=0)

    def measure(setup):
        return runner._measure(runner.System("x", "peer", "0", "test", setup), inputs, fresh, references, timer)

    good = measure(lambda q, k, v, lens: lambda: runner.reference_decode(q, k, v, lens)[0])
    assert good.compiled and good.correct and good.rel_err == 0.0 and good.timing.runs == 2 and good.error is None
    wrong = measure(lambda q, k, v, lens: lambda: torch.zeros_like(q))
    assert wrong.compiled and not wrong.correct and wrong.rel_err == 1.0
    broken = measure(lambda q, k, v, lens: 1 / 0)
    assert not broken.compiled and not broken.correct and "ZeroDivisionError" in broken.error


def test_git_commit_marks_uncommitted_changes(runner, tmp_path, monkeypatch):
    """A run from a modified checkout must not claim a clean commit: the hash gets "-dirty"."""
    import flashdecode

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    package = tmp_path / "flashdecode"
    package.mkdir()
    (package / "__init__.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "empty")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "package")
    monkeypatch.setattr(flashdecode, "__file__", str(package / "__init__.py"))
    clean = runner.git_commit()
    assert clean is not None and len(clean) == 40
    (package / "__init__.py").write_text("x = 2\n")
    assert runner.git_commit() == clean + "-dirty"


def test_source_digest_names_the_code_not_the_checkout(runner, tmp_path, monkeypatch):
    """The digest changes with any package source and with nothing else (it needs no git)."""
    import flashdecode

    package = tmp_path / "flashdecode"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (package / "sub" / "k.py").write_text("y = 1\n")
    monkeypatch.setattr(flashdecode, "__file__", str(package / "__init__.py"))
    first = runner.source_digest()
    assert len(first) == 12 and runner.source_digest() == first
    (tmp_path / "notes.txt").write_text("outside the package")
    assert runner.source_digest() == first
    (package / "sub" / "k.py").write_text("y = 2\n")
    assert runner.source_digest() != first


def test_tilelang_backend_needs_a_hopper(runner, monkeypatch):
    """On another GPU the TileLang backend is skipped with the reason, not timed into 14 failures."""
    from flashdecode.bench import BenchError

    monkeypatch.setattr(runner, "is_hopper", lambda index: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Fake A100")
    with pytest.raises(BenchError, match="needs a Hopper GPU .*Fake A100"):
        runner._our_backend("tilelang", cuda=True)
