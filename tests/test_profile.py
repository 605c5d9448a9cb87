"""``flashdecode profile`` on CPU: plan-based dimensions, pattern rules, ncu's CSV, the report built
from recorded counters (tests/fixtures/ncu_case12_*.csv), the no-ncu path, the trace reader, the CLI.

The fixtures are real ncu captures of case 12 on the H200, one per backend (docs/diagnosis.md says
how to refresh them); the report tests run on each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import cli_fails
from flashdecode import cases, cli, hardware, plan_for, planner
from flashdecode.bench.timing import Timer
from flashdecode.profile import catalogue, command, geometry, ncu, report, shape, timeline
from flashdecode.kernels import get_backend
from flashdecode.kernels.tilelang import occupancy as tilelang_occupancy

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = sorted((REPO / "tests" / "fixtures").glob("ncu_case12_*.csv"))
H200, C500 = hardware.PROFILES["h200"], hardware.PROFILES["c500"]
NO_CUDA = not torch.cuda.is_available()


def _shape(number: int) -> shape.Shape:
    return shape.Shape(cases.CASES_BY_NUMBER[number])


def _plan_section(number: int, profile=H200, backend=None) -> dict:
    return report.section(_shape(number), profile, backend=backend)


# --- plan-based dimensions ----------------------------------------------------------------------

def test_schedule_on_known_work():
    assert geometry.schedule([1.0] * 4, 4) == (0.0, 0.0)
    idle, last = geometry.schedule([1.0] * 5, 4)  # one program in a second wave
    assert idle == pytest.approx(1 - 5 / 8) and last == pytest.approx(1 - 1 / 4)
    assert geometry.schedule([2.0, 1.0, 1.0], 2) == (0.0, 0.0)  # the third fills the second slot's gap
    idle, last = geometry.schedule([4.0, 1.0], 2)  # one wave, one long program
    assert idle == pytest.approx(1 - 5 / 8) and last == pytest.approx(1 - 5 / 8)
    assert geometry.schedule([0.0, 0.0], 2) == (0.0, 0.0)


def _planning(problem, profile=H200, backend=None):
    """The plan and residency a plan-only report shows: those of ``backend``, else of the one auto runs there."""
    backend = get_backend(backend or report.auto_backend(problem, profile))
    plan = planner.plan(problem, profile, backend)
    return plan, backend.resident_programs(problem, plan.config, profile)


def test_case12_plan_figures_on_h200():
    problem, lengths = _shape(12).problem(), _shape(12).lengths()
    plan, resident = _planning(problem)
    dims = _plan_section(12)["dimensions"]
    occupancy, tail = dims["occupancy"]["figures"], dims["tail"]["figures"]
    with_work = sum(planner.splits_per_sequence(plan, lengths)) * problem.nheads_k
    assert occupancy["grid"] == [plan.programs_per_head, 8, 1]
    assert occupancy["combine_grid"] == [8, 32]
    assert occupancy["programs_launched"] == plan.programs_per_head * 8
    assert occupancy["programs_with_work"] == with_work
    assert occupancy["programs_per_sm"] == pytest.approx(with_work / 132)
    assert occupancy["waves"] == pytest.approx(plan.programs_per_head * 8 / (132 * resident))
    assert occupancy["waves_with_work"] == pytest.approx(with_work / (132 * resident))
    tokens = [item.tokens for item in planner.work_list(plan, lengths)]
    assert (tail["tokens_min"], tail["tokens_max"]) == (min(tokens), max(tokens))
    assert tail["max_over_mean_work"] == pytest.approx(max(tokens) * len(tokens) / sum(lengths))
    assert tail["slots"] == 132 * resident
    assert set(dims) == {"occupancy", "tail"}


def test_unsplit_single_block_case_is_a_small_grid():
    occupancy = _plan_section(1)["dimensions"]["occupancy"]  # b1 s1 hk4: one block, no split
    assert occupancy["figures"]["grid"] == [1, 4, 1] and occupancy["figures"]["combine_grid"] is None
    assert occupancy["figures"]["programs_with_work"] == 4
    assert occupancy["patterns"] == ["small_grid"]


def test_one_long_sequence_fills_exactly_one_wave():
    dims = _plan_section(13, backend="tilelang")["dimensions"]  # b1 s58966 hk8: splits x 8 heads = one wave
    slots = 132 * _planning(_shape(13).problem(), backend="tilelang")[1]
    extra = slots // 8  # the planner's P - B
    assert dims["occupancy"]["figures"]["programs_with_work"] == extra * 8
    assert dims["occupancy"]["figures"]["waves_with_work"] == pytest.approx(extra * 8 / slots)
    assert dims["occupancy"]["figures"]["waves"] == pytest.approx((extra + 1) * 8 / slots)
    assert dims["tail"]["figures"]["max_over_mean_work"] < 1.05
    assert dims["tail"]["figures"]["last_wave_idle_fraction"] < 0.25
    assert dims["tail"]["patterns"] == []


def test_c500_shared_memory_model_against_the_plan_in_view():
    """The C500 plan in view runs 32 q rows on 32-token K/V tiles (head dim 128, bf16). Its two
    pipelined K/V stages are the 32 KiB the block_n rule gives each of two programs (64 KiB per
    AP); with the q tile, P, the length scan and the launch reserve a program needs 44 KiB, so the
    model holds one per AP; single-staged it needs 28 KiB and holds two. docs/hardware/c500.md
    says what would have to be true of the AP for two double-staged programs."""
    problem = _shape(12).problem()
    plan = planner.plan(problem, C500, get_backend("tilelang"))
    assert plan.block_n == 32 and tilelang_occupancy.largest_block_n(problem, C500) == 32
    view = dataclasses.replace(plan.config, block_m=32, block_n=32)
    stages = view.num_stages * 2 * 32 * problem.headdim * 2
    assert view.num_stages == 2 and 2 * stages == C500.shared_memory_per_multiprocessor
    double = tilelang_occupancy.split_shared_bytes(problem, view, C500)
    single = tilelang_occupancy.split_shared_bytes(problem, dataclasses.replace(view, num_stages=1), C500)
    assert (double, single) == (44 * 1024, 28 * 1024)
    assert get_backend("tilelang").resident_programs(problem, view, C500) == 1
    assert get_backend("tilelang").resident_programs(problem, dataclasses.replace(view, num_stages=1), C500) == 2


@pytest.mark.parametrize("name, headdim", [
    ("triton", 64), ("triton", 128), ("triton", 256), ("tilelang", 64), ("tilelang", 128),
    pytest.param("tilelang", 256, marks=pytest.mark.xfail(
        strict=True, reason="TileLang's 64-row q tile and 16-token stages need 66 KiB at head dim 256: over the "
                            "C500's 64 KiB (docs/hardware/c500.md)")),
])
def test_c500_resident_programs_fit_its_shared_memory(name, headdim):
    """A backend's resident split programs on the C500 fit its 64 KiB per AP together."""
    from flashdecode.kernels.triton.backend import padded_headdim, shared_bytes

    problem = shape.Shape(cases.Case(0, 8, 32768, 8, 4), headdim).problem()
    backend = get_backend(name)
    plan = planner.plan(problem, C500, backend)
    resident = backend.resident_programs(problem, plan.config, C500)
    need = shared_bytes(plan.config, padded_headdim(headdim), 2, C500) if name == "triton" else \
        tilelang_occupancy.split_shared_bytes(problem, plan.config, C500)
    assert resident >= 1 and resident * need <= C500.shared_memory_per_multiprocessor, (resident, need)


def test_c500_profile_plans_with_its_own_units():
    occupancy = _plan_section(12, C500)["dimensions"]["occupancy"]["figures"]
    assert occupancy["multiprocessors"] == 104
    assert occupancy["grid"] == list(_planning(_shape(12).problem(), C500)[0].grid(_shape(12).problem()))


# --- pattern rules ------------------------------------------------------------------------------

def _side(condition: catalogue.Condition, holds: bool) -> float:
    step = abs(condition.threshold) * 0.5 + 0.01
    above = (condition.op == ">") == holds
    return condition.threshold + step if above else condition.threshold - step


@pytest.mark.parametrize("pattern", catalogue.PATTERNS, ids=lambda p: p.key)
def test_each_pattern_fires_and_stays_quiet(pattern):
    firing = {c.figure: _side(c, True) for c in pattern.conditions}
    quiet = {c.figure: _side(c, False) for c in pattern.conditions}
    assert pattern.triggered(firing) is True
    assert pattern.triggered(quiet) is False
    line, keys = catalogue.diagnose(pattern.dimension, firing)
    assert pattern.key in keys and pattern.title in line
    for condition in pattern.conditions:
        assert condition.figure in line
    assert catalogue.diagnose(pattern.dimension, quiet)[1] == []


@pytest.mark.parametrize("pattern", [p for p in catalogue.PATTERNS if len(p.conditions) > 1], ids=lambda p: p.key)
def test_compound_patterns_need_all_or_any(pattern):
    first, second = pattern.conditions
    mixed = {first.figure: _side(first, True), second.figure: _side(second, False)}
    assert pattern.triggered(mixed) is pattern.any_of
    assert pattern.triggered({first.figure: _side(first, True)}) is (True if pattern.any_of else None)


def test_named_thresholds():
    latency = next(p for p in catalogue.PATTERNS if p.key == "latency_bound")
    assert latency.triggered({"long_scoreboard_share": 0.55, "dram_fraction_of_ceiling": 0.5}) is True
    assert latency.triggered({"long_scoreboard_share": 0.55, "dram_fraction_of_ceiling": 0.9}) is False
    assert latency.triggered({"long_scoreboard_share": 0.3, "dram_fraction_of_ceiling": 0.5}) is False
    launch = next(p for p in catalogue.PATTERNS if p.key == "launch_bound")
    assert launch.triggered({"kernel_time_us": 6.0, "gap_share": 0.0}) is True
    assert launch.triggered({"kernel_time_us": 60.0, "gap_share": 0.3}) is True
    assert launch.triggered({"kernel_time_us": 60.0, "gap_share": 0.1}) is False
    tail = next(p for p in catalogue.PATTERNS if p.key == "wave_tail")
    assert tail.triggered({"last_wave_idle_fraction": 0.26}) and not tail.triggered({"last_wave_idle_fraction": 0.25})


def test_thirteen_patterns_lettered_a_to_m_each_pointing_into_the_library():
    assert [p.letter for p in catalogue.PATTERNS] == list("ABCDEFGHIJKLM")
    assert catalogue.PATTERNS[0].key == "small_grid"
    assert len({p.key for p in catalogue.PATTERNS}) == 13
    for pattern in catalogue.PATTERNS:
        assert pattern.library and pattern.c500 and pattern.fix
        for entry in pattern.library:
            name, _, anchor = entry.partition("#")
            text = (REPO / "docs" / "patterns" / name).read_text()
            assert f'<a id="{anchor}"></a>' in text, f"{entry} (pattern {pattern.letter}) is not in docs/patterns"


def _recorded_figures(counters: ncu.NcuResult) -> dict:
    """Every figure of case 12's report from a recorded capture, with the plan of the backend it captured."""
    measured = report.Measurements(ceiling_gbps=4484.5, call_us=190.0, counters=counters)
    backend = "tilelang" if ncu.main_kernel(counters.kernels).name.startswith("decode_") else "triton"
    dims = report.section(_shape(12), H200, measured, backend=backend)["dimensions"]
    return {key: value for dim in dims.values() for key, value in dim["figures"].items()}


#: Per pattern, the recorded figures it reads, set as a run that shows it would record them.
SHOWN = {
    "A": {"programs_per_sm": 0.24}, "B": {"residency_vs_plan": 0.5}, "C": {"achieved_over_theoretical": 0.3},
    "D": {"last_wave_idle_fraction": 0.6}, "E": {"max_over_mean_work": 3.0}, "F": {"ceiling_fraction": 0.4},
    "G": {"long_scoreboard_share": 0.7, "dram_fraction_of_ceiling": 0.4}, "H": {"barrier_share": 0.5},
    "I": {"bank_conflict_ratio": 0.6}, "J": {"local_over_problem": 0.2}, "K": {"tensor_active_pct": 2.0},
    "L": {"gap_share": 0.45}, "M": {"dram_read_over_problem": 4.0},
}


@pytest.mark.parametrize("letter", list("ABCDEFGHIJKLM"))
def test_each_pattern_fires_on_recorded_counters_that_show_it(recorded, letter):
    """The recorded capture of case 12, with the figures one pattern reads moved past its threshold:
    that pattern fires in its dimension's diagnosis, by letter; moved to the other side, it does not."""
    pattern = catalogue.BY_LETTER[letter]
    figures = _recorded_figures(recorded)
    line, fired = catalogue.diagnose(pattern.dimension, {**figures, **SHOWN[letter]})
    assert pattern.key in fired and line.count(f"{letter}. {pattern.title}") == 1
    quiet = {condition.figure: _side(condition, False) for condition in pattern.conditions}
    assert pattern.key not in catalogue.diagnose(pattern.dimension, {**figures, **quiet})[1]


@pytest.mark.parametrize("value, shown", [(1.5028, "1.503"), (1.5000001, "1.5000001"), (2.0, "2"), (0.7234, "0.723")])
def test_evidence_shows_the_digits_that_tell_a_figure_from_its_threshold(value, shown):
    """A profile read "max_over_mean_work 1.5 > 1.5" for 1.5028."""
    assert catalogue.Condition("max_over_mean_work", ">", 1.5).evidence({"max_over_mean_work": value}) == \
        f"max_over_mean_work {shown} > 1.5"


def test_missing_figures_leave_patterns_open():
    line, keys = catalogue.diagnose("memory", {})
    assert keys == [] and "extra_dram_traffic" in line and "not evaluated" in line


def test_docs_describe_every_pattern_with_its_threshold():
    docs = (REPO / "docs" / "diagnosis.md").read_text()
    for pattern in catalogue.PATTERNS:
        assert f"`{pattern.key}`" in docs
        for condition in pattern.conditions:
            assert f"`{condition}" in docs, f"docs/diagnosis.md lacks the threshold {condition}"
    assert {p.dimension for p in catalogue.PATTERNS} <= {key for key, _ in catalogue.DIMENSIONS}


# --- ncu's CSV ----------------------------------------------------------------------------------

RAW = '''==PROF== Connected to process 123
"ID","Process ID","Kernel Name","Grid Size","dram__bytes_read.sum","gpu__time_duration.sum","launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","Kbyte","usecond","register/thread","%"
"0","123","void split<int, 2>(float*, int)","(74, 8, 1)","1,234.5","2.5","168","n/a"
"1","123","combine_kernel","(8, 8, 1)","12","0.5","40","6.02"
"2","123","void split<int, 2>(float*, int)","(74, 8, 1)","1,236.5","3.5","168","15.5"
'''


def test_parse_csv_quotes_units_and_separators():
    launches = ncu.parse_csv(RAW)
    assert len(launches) == 3
    first = launches[0]
    assert first["Kernel Name"] == "void split<int, 2>(float*, int)" and first["Grid Size"] == "(74, 8, 1)"
    assert first["dram__bytes_read.sum"] == pytest.approx(1_234_500.0)  # Kbyte -> byte, "," dropped
    assert first["gpu__time_duration.sum"] == pytest.approx(2500.0)  # usecond -> nanosecond
    assert first["launch__registers_per_thread"] == 168.0
    assert first["sm__warps_active.avg.pct_of_peak_sustained_active"] is None  # "n/a"


def test_merge_takes_medians_and_missing_metrics_are_none():
    kernels = ncu.merge(ncu.parse_csv(RAW))
    assert [(k.name, k.role, k.launches) for k in kernels] == [
        ("void split<int, 2>(float*, int)", "split", 2), ("combine_kernel", "combine", 1)]
    split = kernels[0]
    assert split.get("gpu__time_duration.sum") == pytest.approx(3000.0)
    assert split.get("sm__warps_active.avg.pct_of_peak_sustained_active") == 15.5  # the one known value
    assert split.get("dram__bytes_write.sum") is None
    assert ncu.resident_programs(split) is None and ncu.stall_shares(split) is None
    assert ncu.main_kernel(kernels) is split


def test_parse_csv_without_header_or_units_row():
    assert ncu.parse_csv("") == [] and ncu.parse_csv("==ERROR== something failed\n") == []
    no_units = '"ID","Kernel Name","gpu__time_duration.sum"\n"0","k","2,000"\n'
    assert ncu.parse_csv(no_units)[0]["gpu__time_duration.sum"] == 2000.0


def test_stall_shares_read_both_metric_families():
    kernel = ncu.KernelCounters("k", 1, {
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": 6.0,
        "smsp__average_warp_latency_issue_stalled_barrier.ratio": 2.0,
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": None,
    })
    assert ncu.stall_shares(kernel) == {"long_scoreboard": 0.75, "barrier": 0.25}


# --- the report from recorded counters ----------------------------------------------------------

def test_fixtures_are_there():
    assert FIXTURES, "tests/fixtures/ncu_case12_*.csv is missing"


@pytest.fixture(scope="module", params=FIXTURES, ids=lambda path: path.stem)
def recorded(request) -> ncu.NcuResult:
    text = request.param.read_text()
    return ncu.NcuResult(ncu.merge(ncu.parse_csv(text)), None, "recorded", text)


def test_fixture_holds_the_split_kernel(recorded):
    main = ncu.main_kernel(recorded.kernels)
    assert main.role == "split"
    for metric in ("gpu__time_duration.sum", "dram__bytes_read.sum", "launch__registers_per_thread"):
        assert main.get(metric), metric
    assert ncu.resident_programs(main) >= 1


def test_report_from_recorded_counters(recorded, tmp_path):
    measured = report.Measurements(ceiling_gbps=4000.0, call_us=250.0, counters=recorded,
                                   errors={"timeline": "no trace recorded"})
    section = report.section(_shape(12), H200, measured)
    dims = section["dimensions"]
    assert list(dims) == [key for key, _ in catalogue.DIMENSIONS]
    for dim in dims.values():
        assert dim["diagnosis"] and "\n" not in dim["diagnosis"]
    main = ncu.main_kernel(recorded.kernels)
    assert dims["occupancy"]["figures"]["resident_programs_per_sm"] == ncu.resident_programs(main)
    assert dims["occupancy"]["figures"]["registers_per_thread"] == main.get("launch__registers_per_thread")
    assert sum(dims["stalls"]["figures"]["stall_shares"].values()) == pytest.approx(1.0)
    memory = dims["memory"]["figures"]
    assert memory["problem_bytes"] == cases.bytes_read(_shape(12).lengths(), 8, 32)
    assert 0.95 < memory["dram_read_over_problem"] < 1.1  # real captures: each K/V byte read once
    assert dims["timeline"]["figures"]["kernel_time_us"] > 0  # from ncu when there is no trace
    assert "no trace recorded" in dims["timeline"]["source"]
    tail = dims["tail"]["figures"]
    assert tail["ideal_us"] == pytest.approx(memory["problem_bytes"] / 4000.0 / 1e3)
    built = report.build(_shape(12), "triton", "measured", [section], report.notes_for(measured), {})
    json_path, md_path = report.write(built, tmp_path)
    assert json.loads(json_path.read_text())["sections"][0]["dimensions"]["stalls"]["figures"]["top_stall"]
    text = md_path.read_text()
    for _, title in catalogue.DIMENSIONS:
        assert f"### {title}" in text
    assert "| kernel | role |" in text


def test_graph_replay_figures_join_the_timeline(recorded):
    replay = [timeline.Activity("_split_kernel", "kernel", 0.0, 60.0),
              timeline.Activity("_combine_kernel", "kernel", 63.0, 5.0)]
    measured = report.Measurements(ceiling_gbps=4000.0, call_us=250.0, counters=recorded, graph_us=70.0,
                                   graph_activity=replay, errors={"timeline": "no trace recorded"})
    dim = report.section(_shape(12), H200, measured)["dimensions"]["timeline"]
    figures = dim["figures"]
    assert figures["graph_us"] == 70.0 and figures["graph_kernel_count"] == 2
    assert figures["graph_call_span_us"] == pytest.approx(68.0) and figures["graph_gap_us"] == pytest.approx(3.0)
    assert figures["kernel_time_us"] > 0 and "graph-trace.json" in dim["source"]  # the eager figures stay
    failed = report.Measurements(ceiling_gbps=4000.0, call_us=250.0, counters=recorded,
                                 errors={"graph": "the call could not be captured in a CUDA graph"})
    figures = report.section(_shape(12), H200, failed)["dimensions"]["timeline"]["figures"]
    assert figures["graph_us"] is None and "captured" in figures["graph_unavailable"]
    assert not any(key.startswith("graph_kernel") for key in figures)


def test_graph_replay_without_cuda_is_reported_not_raised(tmp_path):
    measured = report.Measurements()
    command.trace_graph(lambda: None, Timer(torch.device("cpu"), iters=1, warmup=0), tmp_path / "g.json", measured)
    assert measured.graph_us is None and measured.graph_activity is None
    assert "CUDA" in measured.errors["graph"] and not (tmp_path / "g.json").exists()


def test_a_traced_replay_stands_for_a_missing_call_trace():
    replay = [timeline.Activity("_split_kernel", "kernel", 0.0, 60.0)]
    measured = report.Measurements(ceiling_gbps=4000.0, call_us=250.0, graph_us=61.0, graph_activity=replay,
                                   counters=ncu.NcuResult(kernels=[], error="ncu not found"),
                                   errors={"timeline": "torch.profiler failed"})
    dim = report.section(_shape(12), H200, measured)["dimensions"]["timeline"]
    assert dim["unavailable"] is None and dim["source"] == "a graph replay (graph-trace.json)"
    assert dim["figures"]["graph_kernel_count"] == 1 and not dim["diagnosis"].startswith("not measured")


# --- without counters ---------------------------------------------------------------------------

def test_missing_ncu_is_reported_not_raised(tmp_path):
    result = ncu.collect(["--case", "12", "--backend", "triton"], tmp_path, ncu="no-such-ncu-here")
    assert result.kernels == [] and "ncu not found" in result.error
    measured = report.Measurements(ceiling_gbps=4000.0, call_us=250.0, counters=result)
    dims = report.section(_shape(12), H200, measured)["dimensions"]
    for key in ("stalls", "tensor"):
        assert dims[key]["unavailable"] == result.error and "not measured" in dims[key]["diagnosis"]
    assert dims["memory"]["figures"]["call_gbps"] == pytest.approx(_shape(12).problem_bytes() / 250.0 / 1e3)
    assert "dram_read_bytes" not in dims["memory"]["figures"]
    assert any("ncu not found" in note for note in report.notes_for(measured))


FAKE_NCU = '''#!{python}
"""A stand-in for ncu: {behaviour}."""
import pathlib, sys
args = sys.argv[1:]
state = pathlib.Path({state!r})
if "--import" in args:
    print(pathlib.Path({fixture!r}).read_text())
    sys.exit(0)
runs = int(state.read_text()) if state.exists() else 0
state.write_text(str(runs + 1))
metrics = args[args.index("--metrics") + 1].split(",")
if {behaviour!r} == "no-permission":
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters")
    sys.exit(1)
if {behaviour!r} == "unknown-metric" and "{unknown}" in metrics:
    print("==ERROR== Failed to find metric {unknown}")
    sys.exit(1)
pathlib.Path(args[args.index("--export") + 1]).write_text("report")
'''


def _fake_ncu(tmp_path, behaviour) -> str:
    path = tmp_path / "fake-ncu"
    path.write_text(FAKE_NCU.format(python=sys.executable, behaviour=behaviour, state=str(tmp_path / "runs"),
                                    fixture=str(FIXTURES[0]), unknown=ncu.METRICS[-1]))
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(os.name != "posix", reason="the stand-in ncu is a script with a shebang")
def test_collect_reads_the_imported_csv(tmp_path):
    result = ncu.collect(["--case", "12", "--backend", "triton"], tmp_path, ncu=_fake_ncu(tmp_path, "ok"))
    assert result.error is None and ncu.main_kernel(result.kernels).role == "split"
    assert "--clock-control none" in result.command and "flashdecode.profile.target --case 12" in result.command


@pytest.mark.skipif(os.name != "posix", reason="the stand-in ncu is a script with a shebang")
def test_collect_explains_missing_permission(tmp_path):
    result = ncu.collect(["--case", "12", "--backend", "triton"], tmp_path, ncu=_fake_ncu(tmp_path, "no-permission"))
    assert result.kernels == [] and "ERR_NVGPUCTRPERM" in result.error


@pytest.mark.skipif(os.name != "posix", reason="the stand-in ncu is a script with a shebang")
def test_collect_drops_a_metric_ncu_does_not_know(tmp_path):
    result = ncu.collect(["--case", "12", "--backend", "triton"], tmp_path, ncu=_fake_ncu(tmp_path, "unknown-metric"))
    assert result.error is None and result.dropped == [ncu.METRICS[-1]]
    assert (tmp_path / "runs").read_text() == "2"


def test_explain_failure_names_known_causes():
    assert "LibraryNotLoaded" in ncu.explain_failure("==ERROR== LibraryNotLoaded: libfoo.so", 1)
    assert "exit status 3" in ncu.explain_failure("==ERROR== the application returned an error", 3)


# --- the trace ----------------------------------------------------------------------------------

def _event(name, cat, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_last_call_and_its_gaps():
    trace = {"traceEvents": [
        _event(timeline.CALL_RANGE, "user_annotation", 100.0, 50.0),
        _event("_split_kernel", "kernel", 110.0, 20.0),
        _event("FillFunctor", "kernel", 200.0, 5.0),  # the flush between calls: outside both ranges
        _event(timeline.CALL_RANGE, "user_annotation", 300.0, 100.0),
        _event("Memset (Device)", "gpu_memset", 310.0, 2.0),
        _event("_split_kernel", "kernel", 314.0, 60.0),
        _event("_combine_kernel", "kernel", 380.0, 6.0),
        _event("cudaLaunchKernel", "cuda_runtime", 305.0, 3.0),
    ]}
    activity = timeline.last_call(trace)
    assert [a.name for a in activity] == ["Memset (Device)", "_split_kernel", "_combine_kernel"]
    assert [a.start_us for a in activity] == [0.0, 4.0, 70.0]
    figures = timeline.figures(activity)
    assert figures["kernel_time_us"] == pytest.approx(66.0) and figures["kernel_count"] == 2
    assert figures["call_span_us"] == pytest.approx(76.0)
    assert figures["gap_us"] == pytest.approx(2.0 + 6.0)
    assert figures["gap_share"] == pytest.approx(8.0 / 76.0)
    assert figures["extra_activity"] == ["Memset (Device)"]
    assert timeline.last_call({"traceEvents": []}) == []


# --- shapes and the command line ----------------------------------------------------------------

def _parse(argv):
    parser = argparse.ArgumentParser()
    shape.add_arguments(parser)
    return shape.from_args(parser.parse_args(argv))


def test_shapes_round_trip_through_their_arguments():
    custom = shape.Shape(cases.Case(0, 3, 1000, 2, 8), 64, "float16")
    for item in (_shape(12), custom):
        assert _parse(item.argv()) == item
    assert custom.label == "b3-s1000-hk2-g8-d64-float16" and _shape(12).label == "case12"
    assert custom.lengths() == cases.case_seqlens(3, 1000).tolist()
    for variant in cases.VARIANTS:
        for item in (dataclasses.replace(_shape(12), variant=variant), dataclasses.replace(custom, variant=variant)):
            assert _parse(item.argv()) == item
    assert dataclasses.replace(_shape(12), variant="paged64").label == "case12-paged64"


@pytest.mark.parametrize("label", ["7", "W8", "W11", "M1"])
def test_a_case_of_any_matrix_is_profiled_as_the_benchmark_calls_it(label):
    """--case takes the labels of every matrix (the candidates log's): the case's head dim and
    length rule (W8: head dim 64; W11 skewed; M1 uniform), named again by its arguments."""
    item = _parse(["--case", label])
    case = cases.CASES_BY_LABEL[label]
    assert item.case == case and item.headdim == case.headdim and item.label == f"case{label}"
    call = item.call("cpu")
    assert call.lengths == item.lengths() == case.seqlens().tolist() and call.q.shape[-1] == case.headdim
    assert _parse(item.argv()) == item


def test_a_shape_as_bench_spells_it_is_profiled_with_its_own_length_rule():
    """--shape takes one item of bench --shapes (the candidates log names such shapes so): its head
    dim and lengths, any dtype and variant, named again by its arguments."""
    item = _parse(["--shape", "3x1000x2x8x96:uniform", "--dtype", "float16", "--variant", "q4"])
    assert (item.case.batch, item.case.seqlen_cache, item.case.nheads_k, item.case.group) == (3, 1000, 2, 8)
    assert (item.headdim, item.dtype, item.variant) == (96, "float16", "q4")
    assert item.lengths() == cases.case_seqlens(3, 1000, "uniform").tolist() != cases.case_seqlens(3, 1000).tolist()
    assert item.label == "b3-s1000-hk2-g8-d96-uniform-float16-q4" and item.call("cpu").q.shape[-1] == 96
    assert _parse(item.argv()) == item


@pytest.mark.parametrize("variant", list(cases.VARIANTS))
@pytest.mark.parametrize("headdim", [64, 128])
def test_a_variants_problem_is_what_its_call_validates_to(variant, headdim):
    """The plan-only report plans the Problem the profiled call would run, bytes included."""
    item = shape.Shape(cases.Case(0, 3, 100, 2, 4), headdim, "float16", variant)
    call = item.call("cpu")
    assert plan_for(call.q, call.k_cache, call.v_cache, **call.kwargs()).problem == item.problem()
    assert call.lengths == item.lengths() and call.bytes_moved() == item.problem_bytes()


@pytest.mark.parametrize("argv, message", [
    (["profile", "--case", "99"], "unknown case 99"),
    (["profile", "--case", "12", "--backend", "cuda"], "invalid choice"),
    (["profile"], "need --case LABEL"),
    (["profile", "--batch", "2", "--seqlen-cache", "64"], "need --case LABEL"),
    (["profile", "--case", "3", "--batch", "2"], "not both: --case with --batch"),
    (["profile", "--case", "2", "--dtype", "float16"], "not both: --case with --dtype"),
    (["profile", "--case", "W99"], r"unknown case W99: cases are 1-14, W1-W14, M1-M16"),
    (["profile", "--batch", "0", "--seqlen-cache", "64", "--nheads-k", "2", "--group", "4"], "positive integer"),
    (["profile", "--case", "3", "--shape", "1x8x2x4x64:equal"], "give --case or --shape, not both"),
    (["profile", "--shape", "1x8x2x4x64:equal", "--group", "4"], "not both: --shape with --group"),
    (["profile", "--shape", "1x8x2x4x64:equal", "--headdim", "128"], "not both: --shape with --headdim"),
    (["profile", "--case", "3", "--headdim", "128"], "not both: --case with --headdim"),
    (["profile", "--shape", "1x8x2x4x64:equal,2x8x2x4x64:equal"], "--shape takes one shape, got 2"),
    (["profile", "--shape", "1x8x2x4:equal"], "each shape is batch x seqlen_cache"),
    (["profile", "--shape", "1x8x2x4x512:equal"], "--shape's head dim must be at most 256, got 512"),
])
def test_profile_argument_errors(capsys, argv, message):
    cli_fails(capsys, argv, message)


@pytest.mark.skipif(not NO_CUDA, reason="the plan-only report is what a machine without CUDA writes")
@pytest.mark.parametrize("backend", [None, "triton", "tilelang"])
def test_plan_only_report_honours_the_backend(capsys, tmp_path, backend):
    """Case 10: auto runs Triton's split kernel on either profile; a named backend's plan is shown."""
    argv = ["profile", "--case", "10", "--out", str(tmp_path)] + (["--backend", backend] if backend else [])
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    problem = _shape(10).problem()
    for section in data["sections"]:
        profile = hardware.PROFILES[section["hardware"]]
        expected = backend or report.auto_backend(problem, profile)
        assert section["backend"] == expected and section["backend_source"] == ("named" if backend else "auto")
        assert section["plan"] == dataclasses.asdict(planner.plan(problem, profile, get_backend(expected)))
    assert [s["backend"] for s in data["sections"]] == [backend or "triton"] * 2
    out = capsys.readouterr().out
    assert f"## h200 (plan only), backend {backend or 'triton'} ({'named' if backend else 'auto'})" in out


@pytest.mark.skipif(not NO_CUDA, reason="the plan-only report is what a machine without CUDA writes")
@pytest.mark.parametrize("variant", ["ragged", "paged4"])
def test_plan_only_refuses_a_named_backend_that_cannot_take_the_call(capsys, tmp_path, variant):
    """As on a GPU: TileLang takes no ragged queries nor pages under 16 tokens, so it has no plan to show."""
    cli_fails(capsys, ["profile", "--case", "10", "--variant", variant, "--backend", "tilelang",
                       "--out", str(tmp_path)],
              "backend 'tilelang' cannot take this call: it needs")
    assert not (tmp_path / "report.json").exists()


def test_auto_backend_of_a_plan_is_what_auto_runs_on_the_h200():
    """The choices docs/design.md documents: TileLang's short caches on cases 1-4, Triton from case 5 on."""
    assert [report.auto_backend(_shape(n).problem(), H200) for n in (1, 4, 5, 10, 12)] == [
        "tilelang", "tilelang", "triton", "triton", "triton"]


@pytest.mark.slow
@pytest.mark.skipif(not NO_CUDA, reason="the plan-only report is what a machine without CUDA writes")
def test_cli_plan_only_report_end_to_end(tmp_path):
    done = subprocess.run([sys.executable, "-m", "flashdecode", "profile", "--case", "12", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["mode"] == "plan-only" and data["shape"]["case"] == "12"
    assert [s["hardware"] for s in data["sections"]] == ["h200", "c500"]
    for section in data["sections"]:
        assert section["plan_only"] and list(section["dimensions"]) == ["occupancy", "tail"]
    text = (tmp_path / "report.md").read_text()
    assert "PLAN ONLY" in text and "## h200 (plan only), backend triton (auto)" in text
    assert "## c500 (plan only), backend triton (auto)" in text
    assert "### 1. Occupancy and launch geometry" in text and "### 2. Tail effect" in text
    assert "### 1. Occupancy and launch geometry" in done.stdout


@pytest.mark.skipif(not NO_CUDA, reason="the plan-only report is what a machine without CUDA writes")
def test_cli_plan_only_for_a_shape_given_with_flags(tmp_path, capsys):
    argv = ["profile", "--batch", "4", "--seqlen-cache", "4096", "--nheads-k", "2", "--group", "8",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["shape"]["label"] == "b4-s4096-hk2-g8" and data["shape"]["case"] is None
    assert data["lengths"] == cases.case_seqlens(4, 4096).tolist()
    assert math.isclose(data["sections"][0]["dimensions"]["occupancy"]["figures"]["multiprocessors"], 132)


@pytest.mark.gpu
@pytest.mark.parametrize("named", [["--case", "3"], ["--shape", "3x500x2x4x64:uniform", "--variant", "fp8"]])
def test_measured_profile_without_ncu(tmp_path, capsys, named):
    """On a GPU: timing, ceiling and trace are measured; a missing ncu leaves dimensions 3-4 unmeasured."""
    argv = ["profile", *named, "--backend", "triton", "--out", str(tmp_path), "--ncu", "no-such-ncu-here"]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["lengths"] == _parse(named).lengths()
    dims = data["sections"][0]["dimensions"]
    assert data["mode"] == "measured" and list(dims) == [key for key, _ in catalogue.DIMENSIONS]
    assert dims["stalls"]["unavailable"] and dims["memory"]["figures"]["call_us"] > 0
    assert dims["timeline"]["figures"]["kernel_count"] >= 1 and (tmp_path / "trace.json").exists()
    graph = dims["timeline"]["figures"]  # Triton's call is captured, timed and traced from a replay
    assert graph["graph_us"] > 0 and graph["graph_kernel_count"] >= 1 and "graph_unavailable" not in graph
    assert data["files"]["graph_trace"] == "graph-trace.json" and (tmp_path / "graph-trace.json").exists()
