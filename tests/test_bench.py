"""The benchmark's parts on CPU: matrices and variants, statistics and loops, peers' plumbing (with
stand-in modules), the runner's measuring and baseline, machine lines, writers, the FA2 build script."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import io
import itertools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import types

import pytest
import torch

from flashdecode import cases
from flashdecode.bench import Unsupported, candidates, correctness, peers, report
from flashdecode.bench.results import BenchRun, CaseRun, Ceiling, Result, System
from flashdecode.bench.timing import GRAPH_WARMUP, Timer, Timing, summarize
from flashdecode.reference import reference_attention, relative_error

REPO = pathlib.Path(__file__).resolve().parents[1]
ANCHOR = json.loads((REPO / "flashdecode" / "data" / "h200-peers.json").read_text())
SPEC_LINE = ("CASE:10 COMPILED:True CORRECT:True BACKEND:tilelang RUNTIME:0.0623 REF_RUNTIME:0.0618 "
             "SPEEDUP:0.9912x BW_GBPS:2710 BW_FRACTION:0.60")
#: A small case off every block boundary: 3 sequences, 40-token cache, lengths 40, 40, 14.
SMALL = cases.Case(0, 3, 40, 2, 4, 64, "uniform")


def _reference(call):
    return reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())[0]


# --- the matrices -------------------------------------------------------------------------------

@pytest.mark.parametrize("matrix, text, labels", [
    ("cases", "1,3,7-9", ["1", "3", "7", "8", "9"]), ("cases", " 2 , 2,1 ", ["2", "1"]),
    ("cases", "all", [str(n) for n in range(1, 15)]), ("wide", "W2", ["W2"]),
    ("wide", "W1,W3-W5", ["W1", "W3", "W4", "W5"]), ("wide", "all", [f"W{n}" for n in range(1, 15)]),
    ("models", "M16,M2-M3", ["M16", "M2", "M3"]), ("models", "all", [f"M{n}" for n in range(1, 17)]),
])
def test_select_cases_of_either_matrix(matrix, text, labels):
    assert [case.label for case in cases.select(matrix, text)] == labels


@pytest.mark.parametrize("matrix, text, message", [
    ("cases", "0", "unknown case 0"), ("cases", "15", "unknown case 15"), ("cases", "x", "invalid case list"),
    ("cases", "3-1", "invalid case range"), ("cases", "1,", "invalid case list"), ("cases", "W1", "invalid case list"),
    ("wide", "3", "invalid case list"), ("wide", "W3-5", "invalid case list"), ("wide", "W15", "unknown case W15"),
    ("models", "W1", "like M1,M3-M5"), ("models", "M17", "unknown case M17"),
    ("tall", "all", "unknown matrix"),
])
def test_select_rejects(matrix, text, message):
    with pytest.raises(ValueError, match=message):
        cases.select(matrix, text)


def test_wide_matrix_covers_what_the_14_cases_leave_out():
    wide = cases.WIDE_CASES
    assert len(wide) >= 12 and len({case.label for case in wide}) == len(wide)
    assert not {case.label for case in wide} & {case.label for case in cases.CASES}
    assert any(case.group == 1 and case.nheads_k == 32 for case in wide)  # MHA
    assert any(case.nheads_k == 1 for case in wide) and any(case.nheads_k == 2 for case in wide)
    assert {16, 32} <= {case.group for case in wide}
    assert {64, 256} <= {case.headdim for case in wide}
    assert min(case.batch for case in wide) == 1 and max(case.batch for case in wide) == 256
    assert min(case.seqlen_cache for case in wide) == 32 and max(case.seqlen_cache for case in wide) == 256 * 1024
    assert {"equal", "uniform", "skewed"} <= {case.lengths for case in wide}
    assert all(case.nheads <= 64 for case in wide)  # TileLang's q tile holds a group of at most 64


def test_models_matrix_covers_groups_and_head_dims_of_served_models():
    models = cases.MODEL_CASES
    labels = {case.label for case in models}
    assert len(labels) == len(models) and not labels & {case.label for matrix in (cases.CASES, cases.WIDE_CASES)
                                                        for case in matrix}
    assert {2, 3, 5, 6, 7, 12} <= {case.group for case in models}  # groups off the powers of two
    assert {1, 71} <= {case.group for case in models}  # MHA, and Falcon's 71 heads on one KV head
    assert {64, 80, 96, 128, 256} <= {case.headdim for case in models}
    assert min(case.batch for case in models) == 1 and max(case.batch for case in models) == 256


@pytest.mark.parametrize("rule", cases.LENGTH_RULES)
def test_length_rules(rule):
    lengths = cases.case_seqlens(33, 4096, rule)
    assert lengths.dtype == torch.int32 and lengths[0] == 4096 and lengths.min() >= 1 and lengths.max() <= 4096
    low, high = {"matrix": (1024, 4096), "equal": (4096, 4096), "uniform": (1, 4096),
                 "skewed": (1, 4096 // cases.SKEW_RATIO)}[rule]
    assert low <= lengths[1:].min() and lengths[1:].max() <= high
    assert torch.equal(lengths, cases.case_seqlens(33, 4096, rule))  # seeded
    assert cases.case_seqlens(1, 77, rule).tolist() == [77]
    if rule in ("uniform", "skewed"):
        assert len(set(lengths.tolist())) > 10
    with pytest.raises(ValueError, match="rule must be one of"):
        cases.case_seqlens(2, 8, "normal")


def test_variants_compute_what_the_plain_cache_defines():
    """Pages in shuffled order hold the plain cache: the reference gives the same output; q4 and
    append change what the reference must compute, and bytes count what the call moves."""
    plain = cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float32)
    expected = _reference(plain)
    for size in (1, 4, 16, 64, 256):
        call = cases.make_call(SMALL, cases.VARIANTS[f"paged{size}"], dtype=torch.float32)
        blocks = -(-SMALL.seqlen_cache // size)
        assert call.k_cache.shape == (SMALL.batch * blocks, size, SMALL.nheads_k, SMALL.headdim)
        assert sorted(call.block_table.flatten().tolist()) == list(range(SMALL.batch * blocks))
        if blocks > 1:
            assert call.block_table.flatten().tolist() != list(range(SMALL.batch * blocks))  # shuffled
        assert relative_error(_reference(call), expected) == 0.0 and call.bytes_moved() == plain.bytes_moved()
    ordered = cases.make_call(SMALL, cases.VARIANTS["paged16-ordered"], dtype=torch.float32)
    assert ordered.block_table.flatten().tolist() == list(range(ordered.block_table.numel()))
    assert relative_error(_reference(ordered), expected) == 0.0
    q4 = cases.make_call(SMALL, cases.VARIANTS["q4"], dtype=torch.float32)
    assert q4.q.shape == (3, 4, SMALL.nheads, 64) and q4.causal and torch.equal(q4.k_cache, plain.k_cache)
    out = _reference(q4)
    assert out.shape == q4.q.shape and relative_error(out[:, -1:], expected) > 0.01  # not plain's query
    append = cases.make_call(SMALL, cases.VARIANTS["append"], dtype=torch.float32)
    assert append.cache_seqlens.tolist() == [39, 39, 13] and append.lengths == [40, 40, 14]
    assert append.k.shape == (3, 1, SMALL.nheads_k, 64)
    row = SMALL.nheads_k * 64 * 4
    assert append.bytes_moved() == plain.bytes_moved() + 3 * row * 2
    assert q4.bytes_moved() == plain.bytes_moved() + 2 * 3 * 3 * SMALL.nheads * 64 * 4
    before = _reference(append)
    assert torch.equal(append.k_cache[0, 39], append.k[0, 0])  # written in place ...
    assert torch.equal(_reference(append), before)  # ... and appending again changes nothing


def test_make_call_keeps_the_plain_inputs_of_the_anchor_cases():
    case = cases.CASES_BY_NUMBER[3]
    q, k_cache, v_cache, seqlens = cases.make_inputs(case)
    call = cases.make_call(case, cases.VARIANTS["plain"])
    assert all(torch.equal(a, b) for a, b in ((q, call.q), (k_cache, call.k_cache), (seqlens, call.cache_seqlens)))
    assert call.bytes_moved() == cases.bytes_read(seqlens.tolist(), case.nheads_k, case.nheads)
    assert call.storage_bytes() == 2 * (q.numel() + 2 * k_cache.numel()) + 4 * case.batch


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
    assert timer.flush_bytes == 0 and timer.time_graph(lambda: None) is None and timer.capture(lambda: None) is None
    assert timer.host_overhead_us(lambda: calls.append(1), calls=10, loops=3) > 0 and len(calls) == 37
    with pytest.raises(ValueError):
        Timer(torch.device("cpu"), iters=0, warmup=0)


def test_replays_are_warmed_up_as_graphs_then_timed():
    calls = []
    samples = Timer(torch.device("cpu"), iters=4, warmup=1).replays([lambda: calls.append(0), lambda: calls.append(1)])
    assert [len(times) for times in samples] == [4, 4]
    assert calls.count(0) == calls.count(1) == GRAPH_WARMUP + 1 + 4  # graph warm-up, Timer's, timed


def test_timer_samples_are_the_timed_runs_in_order():
    import time

    # the warm-up's two, then the timed three; the empty run is told apart by 20 ms, not by a few
    # (a busy 2-core machine took 4.3 ms over an empty run on 2026-12-07)
    naps = iter([0.0] * 2 + [0.02, 0.0, 0.04])
    runs = Timer(torch.device("cpu"), iters=3, warmup=2).samples(lambda: time.sleep(next(naps)))
    assert len(runs) == 3 and runs[0] >= 20000 and runs[2] >= 40000 and runs[1] < 20000


def test_eager_loop_runs_every_layer_per_repeat_and_divides():
    import time

    order = []

    def layer(index):
        return lambda: (order.append(index), time.sleep(0.002))

    timing = Timer(torch.device("cpu"), iters=1, warmup=0).eager_loop([layer(0), layer(1), layer(2)], repeats=2)
    assert order == [0, 1, 2] * 3  # one untimed loop, then 2 timed
    assert timing.runs == 2 and 2000 <= timing.min_us < 20000  # per call, not per loop


# --- peers (stand-in modules on CPU) ------------------------------------------------------------

def test_page_table():
    pages = {0: [5, 3, 9], 1: [0, 1, 2]}
    assert peers.page_table([40, 16], 16, pages.__getitem__) == ([0, 3, 4], [5, 3, 9, 0], [8, 16])
    with pytest.raises(ValueError, match="sequence 1 has 0"):
        peers.page_table([3, 0], 16, pages.__getitem__)


def _fake_flashinfer():
    """A stand-in for flashinfer whose wrapper computes from its page table with torch: checks that
    the peer hands FlashInfer the pages, table and lengths of the call."""
    module = types.ModuleType("flashinfer")

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                     paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
            assert layout == "NHD" and use_cuda_graph and workspace.numel() == peers.WORKSPACE_BYTES
            self.buffers = paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer

        def plan(self, indptr, indices, last, nheads, nheads_k, headdim, page_size, q_data_type, kv_data_type):
            assert all(a is b for a, b in zip((indptr, indices, last), self.buffers))
            self.page_size = page_size

        def run(self, q, caches):
            indptr, indices, last = (t.tolist() for t in self.buffers)
            outs = []
            for b in range(q.shape[0]):
                pages = indices[indptr[b]:indptr[b + 1]]
                length = (len(pages) - 1) * self.page_size + last[b]
                k, v = (cache[pages].flatten(0, 1)[:length] for cache in caches)
                outs.append(reference_attention(q[b][None, None], k[None], v[None])[0][0, 0])
            return torch.stack(outs)

    module.BatchDecodeWithPagedKVCacheWrapper = Wrapper
    module.single_decode_with_kv_cache = lambda q, k, v, layout, use_tensor_cores: reference_attention(
        q[None, None], k[None], v[None])[0][0, 0]
    return module


@pytest.mark.parametrize("variant", ["plain", "paged16", "paged64"])
@pytest.mark.parametrize("name", ["flashinfer-tc", "flashinfer-cc"])
def test_flashinfer_batch_peer_reads_the_calls_pages(monkeypatch, name, variant):
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    layers = [cases.make_call(SMALL, cases.VARIANTS[variant], dtype=torch.float32, seed=seed) for seed in (1, 5)]
    peer = peers.PEERS[name]
    assert peer.limitation(layers[0]) is None
    outs = [call() for call in peer.setup(layers)]
    for call, out in zip(layers, outs):  # SMALL's 40-token cache is padded to 48 for pages of 16
        assert relative_error(out, _reference(call)) < 1e-6


def test_flashinfer_single_peer_and_limitations(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    one = dataclasses.replace(SMALL, batch=1)
    call = cases.make_call(one, cases.VARIANTS["plain"], dtype=torch.float32)
    single = peers.PEERS["flashinfer-single"]
    assert relative_error(single.setup([call])[0](), _reference(call)) < 1e-6
    assert "batch 1" in single.limitation(cases.make_call(SMALL, cases.VARIANTS["plain"]))
    for variant in ("q4", "append"):
        varied = cases.make_call(SMALL, cases.VARIANTS[variant])
        assert "no q4, no append" in peers.PEERS["flashinfer-tc"].limitation(varied)
        assert "plain decode only" in peers.PEERS["sdpa"].limitation(varied)
        assert peers.PEERS["fa2"].limitation(varied) is None
    assert "multiple of 256 tokens, got 64" in peers.PEERS["fa2"].limitation(
        cases.make_call(SMALL, cases.VARIANTS["paged64"]))
    assert peers.PEERS["fa2"].limitation(cases.make_call(SMALL, cases.VARIANTS["paged256"])) is None
    assert "plain decode only" in peers.PEERS["flex"].limitation(cases.make_call(SMALL, cases.VARIANTS["paged16"]))


def test_fa2_peer_imports_the_built_folder_and_passes_every_argument(monkeypatch, tmp_path):
    """FLASHDECODE_FA2_PATH names tools/build_fa2.py's output: the probe imports flash_attn from
    there and reports the build; the calls pass k/v, lengths, block table and causal."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "__version__ = '2.8.3'\n"
        "def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table, causal,\n"
        "                            num_splits):\n"
        "    from flashdecode.reference import reference_attention\n"
        "    assert num_splits == 0\n"
        "    return reference_attention(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,\n"
        "                               block_table=block_table, causal=causal)[0]\n")
    (tmp_path / "BUILD.json").write_text(json.dumps({"arch": "-gencode arch=compute_90,code=sm_90",
                                                     "headdims": [64, 128, 256], "disabled": ["DROPOUT", "ALIBI"]}))
    monkeypatch.setenv(peers.FA2_PATH_VARIABLE, str(tmp_path))
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # restored (removed) after the test
    del sys.modules["flash_attn"]
    monkeypatch.setattr(sys, "path", list(sys.path))
    version = peers.PEERS["fa2"].probe()
    assert version.startswith("flash_attn 2.8.3") and "compute_90" in version and "without dropout, alibi" in version
    assert sys.modules["flash_attn"].__file__ == str(package / "__init__.py")
    for variant in ("paged256", "q4", "append"):
        call = cases.make_call(SMALL, cases.VARIANTS[variant], dtype=torch.float32)
        expected = _reference(cases.make_call(SMALL, cases.VARIANTS[variant], dtype=torch.float32))
        assert relative_error(peers.PEERS["fa2"].setup([call])[0](), expected) == 0.0
    for headdim, kernel in ((80, 96), (96, 96), (32, 32)):  # FA2 runs a head dim on the next kernel's
        call = cases.make_call(dataclasses.replace(SMALL, headdim=headdim), cases.VARIANTS["plain"])
        assert f"head dims [64, 128, 256]; head dim {headdim} takes {kernel}'s" in peers.PEERS["fa2"].limitation(call)
    assert peers.PEERS["fa2"].limitation(cases.make_call(dataclasses.replace(SMALL, headdim=120),
                                                         cases.VARIANTS["plain"])) is None


def test_sdpa_peer_masks_each_layers_lengths():
    layers = [cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float32, seed=seed) for seed in (1, 3)]
    for call, out in zip(layers, (fn() for fn in peers.PEERS["sdpa"].setup(layers))):
        assert relative_error(out, _reference(call)) < 1e-5


# --- runner pieces (the runner imports Triton: interpreter mode without CUDA) ---------------------

@pytest.fixture
def runner(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from flashdecode.bench import runner

    return runner


def _selection(runner):
    return runner.Selection(False, [SMALL], [cases.VARIANTS["plain"]], [], [], iters=2, warmup=0, cold_l2=True)


def test_measure_checks_times_skips_and_survives_failures(runner):
    variant = cases.VARIANTS["append"]
    layers = [cases.make_call(SMALL, variant, dtype=torch.float16, seed=seed) for seed in (1, 7)]
    fresh = cases.make_call(SMALL, variant, dtype=torch.float16, seed=runner.FRESH_SEED)
    references = correctness.expected(layers[0]), correctness.expected(fresh)
    timer = Timer(torch.device("cpu"), iters=2, warmup=0)
    made = []

    def setup(calls):
        made.append(len(calls))
        return [lambda call=call: _reference(call) for call in calls]

    def measure(check, setup):
        return runner.measure([System("x", "peer", "0", "test", check, setup)], layers, fresh, references, timer,
                              _selection(runner))[0]

    good = measure(lambda call: {"kernel": "k"}, setup)
    assert good.compiled and good.correct and good.rel_err == 0.0 and good.timing.runs == 2 and good.error is None
    assert good.plan == {"kernel": "k"} and good.host_overhead_us > 0 and good.host_launch_us > 0
    assert good.eager_layers == 2
    assert good.eager.runs == runner.CPU_EAGER_REPEATS and made == [2, 1]  # the layers, then the fresh inputs
    wrong = measure(lambda call: None, lambda calls: [lambda: torch.zeros_like(calls[0].q)] * len(calls))
    assert wrong.compiled and not wrong.correct and wrong.rel_err == 1.0

    def unsupported(call):
        raise Unsupported("pages of 16")

    skipped = measure(unsupported, setup)
    assert skipped.skipped == "pages of 16" and not skipped.compiled and skipped.error is None and len(made) == 2
    broken = measure(lambda call: None, lambda calls: 1 / 0)
    assert not broken.compiled and not broken.correct and "ZeroDivisionError" in broken.error


def test_run_hands_over_each_case_so_far_and_marks_it_partial(runner, monkeypatch):
    """``run``'s ``so_far`` gets the run after each case and variant but the last, with a note that
    says how far it got (``flashdecode bench --json`` writes it, so a run cut by a time limit keeps
    its cases); the finished run has no such note."""
    selection = dataclasses.replace(_selection(runner), cases=[SMALL, dataclasses.replace(SMALL, number=1)],
                                    variants=[cases.VARIANTS["plain"], cases.VARIANTS["q4"]])
    monkeypatch.setattr(runner, "measure_ceiling", lambda timer: None)
    monkeypatch.setattr(runner, "torch_launch_us", lambda timer, calls, loops: 1.0)
    monkeypatch.setattr(runner, "torch_launch_gpu_us", lambda timer: None)
    monkeypatch.setattr(runner, "_run_case", lambda case, variant, *rest: (case.number, variant.name))
    seen = []
    done = runner.run(selection, so_far=lambda run: seen.append((run.cases, run.notes[-1])))
    assert seen == [([(0, "plain")], "partial: 1 of 4 case runs"),
                    ([(0, "plain"), (0, "q4")], "partial: 2 of 4 case runs"),
                    ([(0, "plain"), (0, "q4"), (1, "plain")], "partial: 3 of 4 case runs")]
    assert done.cases == [(0, "plain"), (0, "q4"), (1, "plain"), (1, "q4")]
    assert not any(note.startswith("partial") for note in done.notes)
    # another process's launch is in its settings, not its notes: runs to merge share their notes
    monkeypatch.setattr(runner, "torch_launch_us", lambda timer, calls, loops: 2.0)
    again = runner.run(selection)
    assert again.notes == done.notes and again.settings["torch_launch_us"] == 2.0


#: A large batch of short sequences (1-4 tokens) and one of 256 (row 0), bf16 as on the GPU.
PLANTED = cases.Case(0, 64, 256, 8, 4, 64, "skewed")
PLANTED_HEAD = 13


def _planted(call, honest, plant: str):
    """(out, lse) of the float32 reference (``honest``) with one head of one sequence wrong: zeroed;
    the last key of a sequence of a few tokens dropped; the softmax scale 1% off on the long sequence."""
    out, lse = (tensor.clone() for tensor in honest)
    lengths = call.cache_seqlens
    if plant == "zeroed":
        out[5, :, PLANTED_HEAD] = 0
        return out, lse
    sequence = int(torch.nonzero((lengths >= 2) & (lengths <= 4))[0]) if plant == "key_short" else 0
    kwargs = call.kwargs()
    if plant == "key_short":
        kwargs["cache_seqlens"] = lengths - (torch.arange(len(lengths)) == sequence).to(lengths.dtype)
    else:
        kwargs["softmax_scale"] = 1.01 * call.q.shape[-1] ** -0.5
    wrong_out, wrong_lse = reference_attention(call.q, call.k_cache, call.v_cache, **kwargs)
    out[sequence, :, PLANTED_HEAD] = wrong_out[sequence, :, PLANTED_HEAD]
    lse[sequence, PLANTED_HEAD] = wrong_lse[sequence, PLANTED_HEAD]
    return out, lse


@pytest.fixture(scope="module")
def planted_call():
    """PLANTED's inputs, what they are judged against, and the float32 reference's (out, lse)."""
    call = cases.make_call(PLANTED, cases.VARIANTS["plain"], dtype=torch.bfloat16)
    expected = correctness.expected(call)
    return call, expected, (expected.out, expected.lse)


@pytest.mark.parametrize("plant", ["zeroed", "key_short", "scale"])
def test_one_wrong_head_in_a_large_batch_is_not_correct(runner, planted_call, plant):
    """Each plant passes the old whole-tensor check (||out-ref||/||ref|| <= 0.02) and fails the
    per-row one (out rows; lse for the scale, whose out moves less than bf16 rounding), through
    measure and its machine line; the honest reference passes. (The same inputs serve as the
    fresh ones here.)"""
    call, expected, honest = planted_call
    planted = _planted(call, honest, plant)
    verdict = correctness.judge(planted, expected)
    assert verdict.rel_err <= 0.02 and not verdict.correct
    if plant == "scale":
        assert verdict.lse_error > correctness.LSE_ATOL
    else:
        assert verdict.failed_rows >= 1 and verdict.row_ratio > 1

    def system(output):
        return System(plant, "ours", "0", "test", lambda layer: None, lambda layers: [lambda: output[0]] * len(layers),
                      setup_with_lse=lambda layers: [lambda: output] * len(layers))

    timer = Timer(torch.device("cpu"), iters=1, warmup=0)
    wrong, right = runner.measure([system(planted), system(honest)], [call], call, (expected, expected), timer,
                                  _selection(runner))
    assert not wrong.correct and right.correct and right.row_ratio == 0.0 and right.lse_error == 0.0
    run = CaseRun(PLANTED, PLANTED, cases.VARIANTS["plain"], 0, None, "none", None, [wrong, right])
    assert [line.split()[2] for line in report.machine_lines(types.SimpleNamespace(cases=[run]))] == [
        "CORRECT:False", "CORRECT:True"]


def test_row_tolerance_comes_from_a_same_dtype_run():
    """A row's tolerance is 3x the bf16 torch run's error on it plus eps x its largest value; NaN fails."""
    call = cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.bfloat16)
    expected = correctness.expected(call)
    same = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs(), compute_dtype=torch.bfloat16)[0]
    floor = torch.finfo(torch.bfloat16).eps * expected.out.float().abs().amax(-1) + correctness.OUT_ATOL
    row_error = (same.float() - expected.out.float()).abs().amax(-1)
    assert row_error.max() > 0 and torch.allclose(expected.row_tolerance, 3 * row_error + floor)
    assert correctness.judge((expected.out, expected.lse), expected).correct
    broken = expected.out.clone()
    broken[0, 0, 0, 0] = float("nan")
    assert correctness.judge(broken, expected).row_ratio == float("inf")
    assert not correctness.judge(broken, expected).correct


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_our_backends_pass_the_per_row_check_on_the_matrix(runner, backend):
    """On the GPU, bf16: every case of the 14-case matrix plain, and cases 3, 7 and 10 under every
    variant, pass the per-row check (rows of out and lse) the benchmark applies, through the calls
    it times and checks; a call the backend cannot take is left out."""
    check, _, _, setup_with_lse = runner.call_ours(backend)
    calls = [(case, "plain") for case in cases.CASES]
    calls += [(cases.CASES_BY_NUMBER[n], variant)
              for n in (3, 7, 10) for variant in cases.VARIANTS if variant != "plain"]
    judged = []
    for case, variant in calls:
        call = cases.make_call(case, cases.VARIANTS[variant], "cuda")
        try:
            check(call)
        except Unsupported:
            continue
        expected = correctness.expected(call)
        verdict = correctness.judge(setup_with_lse([call])[0](), expected)
        judged.append((case.label, variant, verdict.row_ratio, verdict.lse_error))
        assert verdict.correct, (case.label, variant, verdict)
    if not judged:
        pytest.skip(f"backend {backend!r} takes none of the calls here")
    lse_errors = [j[3] for j in judged if j[3] is not None]
    print(f"{backend}: worst row error / tolerance {max(j[2] for j in judged):.3f}, worst lse error "
          f"{max(lse_errors, default=float('nan')):.2e} over {len(lse_errors)} of {len(judged)} calls; without lse: "
          f"{[(j[0], j[1]) for j in judged if j[3] is None]}")


def test_our_backend_system_checks_with_plan_for(runner):
    """Our systems ask flashdecode.plan_for: its Plan is recorded, a call the backend cannot take is
    Unsupported; the timed call returns out, the checked one (out, lse), which the per-row check passes."""
    check, setup, _, setup_with_lse = runner.call_ours("triton")
    call = cases.make_call(SMALL, cases.VARIANTS["q4"], dtype=torch.float16)
    plan = check(call)
    assert plan["kernel"] and plan["config"]["block_n"] > 0
    expected = correctness.expected(cases.make_call(SMALL, cases.VARIANTS["q4"], dtype=torch.float16))
    assert isinstance(setup([call])[0](), torch.Tensor)
    verdict = correctness.judge(setup_with_lse([call])[0](), expected)
    assert verdict.correct and verdict.lse_error is not None
    if not torch.cuda.is_available():
        with pytest.raises(Unsupported, match="tilelang"):
            runner.call_ours("tilelang")[0](call)


def test_layer_count_on_cpu(runner):
    call = cases.make_call(SMALL, cases.VARIANTS["plain"])
    assert runner.layer_count(call, _selection(runner)) == runner.CPU_EAGER_LAYERS


def test_torch_launch_is_timed(runner):
    timer = Timer(torch.device("cpu"), iters=1, warmup=0)
    assert 0 < runner.torch_launch_us(timer, 5, 3) < 1e5
    assert runner.torch_launch_gpu_us(timer) is None  # a graph figure needs CUDA


def test_shapes_of_ones_own_are_cases_s1_s2():
    shapes = cases.parse_shapes("16x2048x1x71x64:uniform, 1x8x32x1x128:equal,")
    assert [case.label for case in shapes] == ["S1", "S2"]
    assert (shapes[0].batch, shapes[0].seqlen_cache, shapes[0].nheads_k, shapes[0].group, shapes[0].headdim,
            shapes[0].lengths) == (16, 2048, 1, 71, 64, "uniform")
    assert shapes[1].nheads == 32 and shapes[1].describe() == "b1 s8 hk32 g1 equal"
    assert cases.parse_shapes("") == ()
    for bad in ("16x2048x1x71:uniform", "16x2048x1x71x64", "16x2048x1x71x64:matrix", "0x8x1x1x64:equal",
                "16x2k x1x1x64:equal"):
        with pytest.raises(ValueError, match="batch x seqlen_cache x nheads_k x group x headdim"):
            cases.parse_shapes(bad)


def test_baseline_is_fa2_of_this_run_else_the_anchor_file_else_none(runner):
    case, plain, q4 = cases.CASES_BY_NUMBER[10], cases.VARIANTS["plain"], cases.VARIANTS["q4"]
    ours = _result("triton", "ours", 20.0)
    assert runner.baseline(case, q4, [ours, _result("fa2", "peer", 15.0)], True, ANCHOR) == (
        15.0, "fa2 timed in this run", "fa2")
    us, source, system = runner.baseline(case, plain, [ours, _result("fa2", "peer", 15.0, correct=False)], True,
                                          ANCHOR)
    assert us == ANCHOR["cases"][9]["fa2"]["median_us"] and "h200-peers.json" in source and system is None
    assert runner.baseline(case, q4, [ours], True, ANCHOR)[::2] == (None, None)
    assert runner.baseline(cases.WIDE_CASES[0], plain, [ours], True, ANCHOR)[::2] == (None, None)
    off_the_h200 = runner.baseline(case, plain, [ours], True, None)  # another GPU: the anchor is no baseline
    assert off_the_h200[::2] == (None, None) and "H200" in off_the_h200[1]
    assert runner.baseline(case, plain, [ours, _result("reference", "reference", 5.0)], False, ANCHOR)[::2] == (
        5.0, "reference")


@pytest.mark.parametrize("device, applies", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False),
                                             ("NVIDIA GH200 480GB", False)])
def test_the_anchor_is_a_baseline_on_its_own_gpu_only(runner, device, applies):
    assert runner.anchor_for(device) == (ANCHOR if applies else None)


def test_select_rejects_unknown_variants(runner):
    from flashdecode.bench import BenchError

    with pytest.raises(BenchError, match=r"unknown variants \['q8'\]"):
        runner.select(runner.Options(cases=(SMALL,), variants=("plain", "q8"), peers=()))


# --- machine lines ------------------------------------------------------------------------------

def test_machine_line_spec_example_round_trips():
    fields = report.parse_machine_line(SPEC_LINE)
    assert fields == {"case": 10, "compiled": True, "correct": True, "backend": "tilelang", "runtime": 0.0623,
                      "ref_runtime": 0.0618, "speedup": 0.9912, "bw_gbps": 2710, "bw_fraction": 0.60}
    assert report.format_machine_line(fields) == SPEC_LINE


def test_machine_lines_of_a_run_parse_back(fake_run):
    lines = report.machine_lines(fake_run)
    assert len(lines) == 3  # our backend where it took the call; peers get no machine line
    good, failed, wide = (report.parse_machine_line(line) for line in lines)
    assert good == report.machine_fields(fake_run.cases[0], fake_run.cases[0].results[0])
    assert good["case"] == 1 and good["runtime"] == 0.0123 and good["speedup"] == round(8.06 / 12.3456, 4)
    assert good["bw_gbps"] == 1  # 18432 bytes in 12.3 us
    assert failed["case"] == "2/q4" and failed["correct"] is False and failed["speedup"] is None
    assert "SPEEDUP:n/a" in lines[1] and "CORRECT:False" in lines[1]
    assert wide["case"] == "W3" and "CASE:W3 " in lines[2]


def test_parse_machine_line_takes_the_six_field_line():
    """The loop's short line (no CASE, no bandwidth) parses, the missing fields None."""
    fields = report.parse_machine_line("COMPILED:True CORRECT:False BACKEND:triton RUNTIME:0.0500 "
                                       "REF_RUNTIME:0.0618 SPEEDUP:1.2360x")
    assert fields == {"case": None, "compiled": True, "correct": False, "backend": "triton", "runtime": 0.05,
                      "ref_runtime": 0.0618, "speedup": 1.236, "bw_gbps": None, "bw_fraction": None}
    with pytest.raises(ValueError, match="SPEEDUP"):
        report.parse_machine_line("COMPILED:True CORRECT:True BACKEND:triton RUNTIME:0.05 REF_RUNTIME:0.06")


def test_parse_machine_line_rejects_garbage():
    with pytest.raises(ValueError):
        report.parse_machine_line("CASE:1 FOO:2")
    with pytest.raises(ValueError):
        report.parse_machine_line("CASE:1 BACKEND:triton")


# --- writers ------------------------------------------------------------------------------------

def _result(system, kind, median, correct=True, speedup=None, error=None, skipped=None):
    if skipped:
        return Result(system, kind, skipped=skipped)
    timing = Timing(median, median * 0.9, median * 1.1, 100)
    return Result(system, kind, compiled=True, correct=correct, rel_err=1e-3 if correct else float("nan"),
                  fresh_rel_err=1e-3, timing=timing, graph=Timing(median / 2, median / 2, median / 2, 100),
                  host_overhead_us=9.5, eager=Timing(median * 0.8, median * 0.7, median * 0.9, 20), eager_layers=32,
                  bandwidth_gbps=18432 / median / 1e3, fraction=0.5, speedup=speedup,
                  plan={"kernel": "split", "config": {"block_n": 64, "block_m": 16, "merge_step": None},
                        "programs_per_head": 3, "forced_splits": 0, "merge_in_split": True, "dependent_combine": False}
                  if kind == "ours" else None, error=error)


@pytest.fixture
def fake_run():
    case1, case2, wide3 = cases.CASES_BY_NUMBER[1], cases.CASES_BY_NUMBER[2], cases.WIDE_CASES[2]
    plain, q4 = cases.VARIANTS["plain"], cases.VARIANTS["q4"]
    ours = System("triton", "ours", "flashdecode 0.2.0", "flash_attn_with_kvcache", None, None)
    peer = System("sdpa", "peer", "torch 2.11", "torch SDPA", None, None)
    return BenchRun(
        environment={"device": "Fake GPU", "cuda": True, "versions": {"torch": "2.11"}, "git_commit": "abc",
                     "date": "2026-11-29T00:00:00+00:00"},
        settings={"iters": 100, "torch_launch_us": 4.25},
        ceiling=Ceiling("fake read", 2 ** 31, 500.0, 4295.0),
        systems=[ours, peer], skipped=["fa2: not installed"], notes=["baseline from the file"],
        cases=[
            CaseRun(case1, case1, plain, 18432, 8.06, "fa2 from the file", None,
                    [_result("triton", "ours", 12.3456, speedup=8.06 / 12.3456), _result("sdpa", "peer", 300.0)]),
            CaseRun(case2, case2, q4, 94208, None, "none", None,
                    [_result("triton", "ours", 50.0, correct=False),
                     _result("sdpa", "peer", 0, skipped="plain decode only")]),
            CaseRun(wide3, wide3, plain, 94208, None, "none", None,
                    [_result("triton", "ours", 40.0), _result("sdpa", "peer", 40.0, error="boom")]),
        ])


def test_json_has_the_whole_run(fake_run, tmp_path):
    path = tmp_path / "run.json"
    path.write_text("an earlier run")
    report.write_json(fake_run, path)  # over it, by a rename: no half-written file at any time
    assert [entry.name for entry in tmp_path.iterdir()] == ["run.json"]
    data = json.loads(path.read_text())
    assert data["device"] == "Fake GPU" and data["git_commit"] == "abc" and data["ceiling"]["gbps"] == 4295.0
    assert data["settings"]["torch_launch_us"] == 4.25
    first = data["cases"][0]
    assert (first["case"], first["matrix"], first["variant"]) == ("1", "cases", "plain")
    assert first["bytes"] == 18432 and first["baseline_us"] == 8.06 and first["baseline_system"] is None
    assert first["shape"]["headdim"] == 128 and first["shape"]["lengths"] == "matrix"
    triton = first["results"]["triton"]
    assert triton["median_us"] == 12.3456 and triton["graph_us"] == 12.3456 / 2 and triton["host_overhead_us"] == 9.5
    assert triton["eager_us"] == pytest.approx(12.3456 * 0.8) and triton["eager_layers"] == 32
    assert triton["plan"]["config"]["block_n"] == 64 and "plan" not in first["results"]["sdpa"]
    assert data["cases"][1]["results"]["triton"]["rel_err"] == "nan"  # JSON has no NaN
    assert data["cases"][1]["variant"] == "q4" and data["cases"][1]["results"]["sdpa"]["skipped"] == "plain decode only"
    assert data["cases"][2]["case"] == "W3" and data["cases"][2]["matrix"] == "wide"


def test_csv_has_a_row_per_case_variant_and_system(fake_run, tmp_path):
    path = tmp_path / "run.csv"
    report.write_csv(fake_run, path)
    rows = list(csv.DictReader(path.open()))
    assert [(row["case"], row["variant"], row["system"]) for row in rows] == [
        ("1", "plain", "triton"), ("1", "plain", "sdpa"), ("2", "q4", "triton"), ("2", "q4", "sdpa"),
        ("W3", "plain", "triton"), ("W3", "plain", "sdpa")]
    assert float(rows[0]["median_us"]) == 12.3456 and rows[5]["error"] == "boom" and rows[2]["correct"] == "False"
    assert rows[0]["eager_layers"] == "32" and float(rows[0]["eager_us"]) > 0 and rows[3]["skipped"]


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
    assert text.startswith(first) and len(text.splitlines()) == 6
    records = [json.loads(line) for line in text.splitlines()]
    assert len({record["id"] for record in records}) == 3  # an id names the run, case and backend
    good, failed, wide = records[:3]
    assert good["validation"] == "pass" and failed["validation"] == "fail" and failed["speedup"] is None
    assert good["runtime_ms"] == pytest.approx(0.0123456) and good["ref_runtime_ms"] == pytest.approx(0.00806)
    assert good["technique"] == "triton split(block_n=64, block_m=16) +merge_in_split"
    assert good["config"]["config"]["block_n"] == 64
    assert good["device"] == "Fake GPU" and good["git_commit"] == "abc" and good["case"] == 1
    assert (failed["case"], failed["variant"]) == ("2/q4", "q4") and (wide["case"], wide["matrix"]) == ("W3", "wide")


def test_host_path_says_what_launched_the_host_time_loop(runner):
    assert runner.host_path_of((10, None), (210, None), 200) == "compiled"
    assert runner.host_path_of((10, None), (150, None), 200) == "python: 60 of 200 calls found no record"
    assert runner.host_path_of((0, None), (0, "FLASHDECODE_HOST_PATH=0"), 200) == "python: FLASHDECODE_HOST_PATH=0"


def test_measure_counts_host_path_hits_over_the_host_time_loop_only(runner, monkeypatch):
    """Hits outside the host-time loop (the first call, the timed runs, the graph) do not count: a
    system whose calls hit everywhere but in that loop reads as the Python path."""
    layers = [cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float16)]
    fresh = cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float16, seed=runner.FRESH_SEED)
    references = correctness.expected(layers[0]), correctness.expected(fresh)
    hits = [0]
    in_loop = [False]

    def setup(calls):
        def call(layer):
            hits[0] += 0 if in_loop[0] else 1
            return _reference(layer)
        return [lambda layer=layer: call(layer) for layer in calls]

    timer = Timer(torch.device("cpu"), iters=2, warmup=0)
    host_loop = timer.host_times

    def only_misses(functions, calls, loops):
        in_loop[0] = True
        try:
            return host_loop(functions, calls, loops)
        finally:
            in_loop[0] = False

    monkeypatch.setattr(timer, "host_times", only_misses)
    system = System("x", "ours", "0", "test", lambda call: {"kernel": "k"}, setup, lambda call: (hits[0], None))
    result = runner.measure([system], layers, fresh, references, timer, _selection(runner))[0]
    timed = runner.CPU_HOST_CALLS * runner.CPU_HOST_LOOPS
    assert hits[0] > 0 and result.host_path == f"python: {timed} of {timed} calls found no record"
    in_loop_hits = dataclasses.replace(system, setup=lambda calls: [lambda: (hits.__setitem__(0, hits[0] + 1),
                                                                             _reference(layers[0]))[1]])
    assert runner.measure([in_loop_hits], layers, fresh, references, timer,
                          _selection(runner))[0].host_path == "compiled"


def test_timer_times_several_functions_in_rounds_of_blocks():
    """Each function's warm-up, then INTERLEAVE_ROUNDS rounds in which each runs a block of
    consecutive runs (the last block shorter where the rounds do not divide the runs)."""
    from flashdecode.bench.timing import INTERLEAVE_ROUNDS

    order = []
    timer = Timer(torch.device("cpu"), iters=2 * INTERLEAVE_ROUNDS - 1, warmup=1)
    samples = timer.interleaved([lambda: order.append("a"), lambda: order.append("b")])
    assert [len(runs) for runs in samples] == [2 * INTERLEAVE_ROUNDS - 1] * 2
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * (INTERLEAVE_ROUNDS - 1) + ["a", "b"]


def test_measure_interleaves_the_systems_and_drops_one_that_fails_while_timed(runner):
    """Every system's timed runs alternate with the others' (in the order given; blocks of one run
    at 3 runs); one that raises in its third timed run is reported with its error and the others
    are timed again without it."""
    layers = [cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float16)]
    fresh = cases.make_call(SMALL, cases.VARIANTS["plain"], dtype=torch.float16, seed=runner.FRESH_SEED)
    references = correctness.expected(layers[0]), correctness.expected(fresh)
    timer = Timer(torch.device("cpu"), iters=3, warmup=1)
    order = []

    def system(name, fail_at=None):
        def setup(calls):
            def call(layer):
                order.append(name)
                if fail_at is not None and order.count(name) == fail_at:
                    raise RuntimeError(f"{name} broke")
                return _reference(layer)
            return [lambda layer=layer: call(layer) for layer in calls]
        return System(name, "peer", "0", "test", lambda call: None, setup)

    results = runner.measure([system("a"), system("b"), system("c", fail_at=4)], layers, fresh, references, timer,
                             _selection(runner))
    # first calls, the warm-ups, then timed runs interleaved until c's 4th call (its 3rd timed run)
    assert order[:12] == ["a", "b", "c"] * 4
    assert order[12:20] == ["a", "b"] * 4  # again without c: warm-up and 3 timed runs
    a, b, c = results
    assert a.correct and b.correct and a.timing.runs == b.timing.runs == 3
    assert c.error == "RuntimeError: c broke" and c.timing is None and not c.correct


def test_table_and_json_name_the_python_host_path(fake_run, tmp_path):
    fake_run.cases[0].results[0].host_path = "python: FLASHDECODE_HOST_PATH=0"
    fake_run.cases[2].results[0].host_path = "compiled"
    table = report.format_table(fake_run)
    assert "host us from the Python path" in table and "case 1 plain triton: python: FLASHDECODE_HOST_PATH=0" in table
    assert "case W3 plain triton" not in table.split("host us from the Python path")[1]
    report.write_json(fake_run, tmp_path / "run.json")
    results = [case["results"] for case in json.loads((tmp_path / "run.json").read_text())["cases"]]
    assert results[2]["triton"]["host_path"] == "compiled" and "host_path" not in results[0]["sdpa"]


def test_table_shows_every_result_and_the_file_baseline(fake_run):
    table = report.format_table(fake_run)
    assert "12.35" in table and "FAIL" in table and "fa2 (file)" in table and "case W3 plain sdpa: boom" in table
    assert "skipped: fa2: not installed" in table and "note: baseline from the file" in table
    assert "system sdpa [torch 2.11]: torch SDPA" in table
    assert "plain torch launch (q.add_(0)): 4.2 us" in table and "eager us" in table and "9.88 x32" in table
    assert "case 2 q4 sdpa: plain decode only" in table and "b64 s8192 hk1 g32 uniform" in table


# --- the markdown page (docs/benchmarks.md) -------------------------------------------------------

def _page_run(fa2_graph_us=(20.0, 9.0), floor_us=5.0):
    """A run as --json writes it: FA2 and our two backends on two plain cases (FA2's medians 20 and
    10 us, TileLang's 10 and 20, Triton's 16 and 8, our GPU times half the median) and their q4 calls
    (case 2's: TileLang skipped, Triton wrong)."""
    def result(kind, median, graph, correct=True, skipped=None):
        if skipped:
            return {"kind": kind, "compiled": False, "correct": False, "skipped": skipped, "error": None}
        return {"kind": kind, "compiled": True, "correct": correct, "median_us": median, "graph_us": graph,
                "host_overhead_us": 12.0, "host_launch_us": 8.0, "eager_us": median, "bandwidth_gbps": 500.0,
                "fraction_of_ceiling": 0.5, "speedup": None, "rel_err": 1e-3 if correct else "nan",
                "skipped": None, "error": None, "plan": {"kernel": "split"} if kind == "ours" else None}

    def case(label, variant, size, fa2, tilelang, triton):
        shape = {"batch": 4, "seqlen_cache": 4096, "nheads_k": 8, "group": 4, "nheads": 32, "headdim": 128,
                 "lengths": "matrix"}
        return {"case": label, "matrix": "cases", "variant": variant, "shape": shape, "matrix_shape": shape,
                "bytes": size, "baseline_us": fa2 and fa2["median_us"], "baseline_source": "fa2 timed in this run",
                "baseline_system": "fa2", "results": {"fa2": fa2, "tilelang": tilelang, "triton": triton}}

    systems = [{"name": name, "kind": kind, "version": "v1", "description": f"{name} call"}
               for name, kind in (("tilelang", "ours"), ("triton", "ours"), ("fa2", "peer"))]
    return {"device": "Fake GPU", "cuda": True, "versions": {"torch": "2.11", "fa2": "flash_attn 2.8.3"},
            "git_commit": "abc123", "source_digest": "digest0", "extension_digest": "digest1",
            "date": "2026-12-05T00:00:00+00:00",
            "settings": {"iters": 50, "warmup": 10, "cold_l2": True, "flush_bytes": 2 ** 28,
                         "torch_launch_us": 8.0, "torch_launch_gpu_us": floor_us, "rel_err_threshold": 0.02},
            "ceiling": {"what": "fake read", "bytes": 2 ** 31, "median_us": 500.0, "gbps": 1000.0},
            "systems": systems, "skipped": ["flex: not installed"], "notes": ["a note"],
            "cases": [case("1", "plain", 100e6, result("peer", 20.0, fa2_graph_us[0]), result("ours", 10.0, 5.0),
                           result("ours", 16.0, 8.0)),
                      case("2", "plain", 1e3, result("peer", 10.0, fa2_graph_us[1]), result("ours", 20.0, 10.0),
                           result("ours", 8.0, 4.0)),
                      case("1", "q4", 100e6, result("peer", 10.0, 9.0), result("ours", 12.0, 6.0),
                           result("ours", 12.0, 7.0)),
                      case("2", "q4", 1e3, result("peer", 10.0, 9.0), result("ours", 0, 0, skipped="no q4 here"),
                           result("ours", 12.0, 6.0, correct=False))]}


def test_speedups_count_wins_per_backend_and_for_the_faster_of_ours():
    table = report.speedups(_page_run())
    assert table[("plain", "cold median", "tilelang")] == pytest.approx([2.0, 0.5])
    assert table[("plain", "cold median", "triton")] == pytest.approx([1.25, 1.25])
    assert table[("plain", "cold median", "best")] == pytest.approx([2.0, 1.25])  # the faster per case
    assert table[("plain", "GPU time", "best")] == pytest.approx([4.0, 2.25])
    assert table[("q4", "cold median", "triton")] == pytest.approx([10 / 12])  # case 2's is wrong: none
    assert table[("q4", "cold median", "best")] == pytest.approx([10 / 12])  # case 1's; case 2 has none


def test_page_headroom_bounds_every_case_by_the_ceiling_and_one_launch():
    run = _page_run(fa2_graph_us=(200.0, 10.0))
    bounds = report.headroom(run, fractions=(1.0, 0.5))
    assert bounds[1.0] == pytest.approx(2.0)  # 200 / 100 us at the ceiling, 10 / 5 us at the floor
    assert bounds[0.5] == pytest.approx(math.sqrt(2.0))  # the big case at 200 us: level with FA2
    run["settings"]["torch_launch_gpu_us"] = None
    assert report.headroom(run) == {}


def test_markdown_page_states_provenance_times_summary_and_failures():
    page = report.markdown(_page_run())
    assert "commit `abc123`, sources digest `digest0`, extension digest `digest1`" in page
    assert "2026-12-05T00:00:00+00:00" in page and "Versions: torch 2.11." in page  # peers' in their table
    assert "| fa2 (peer) | v1 | fa2 call |" in page and "Left out: flex: not installed" in page
    assert "| 1 | 4, 4096, 8, 4, 128 (lengths S/4..S) | 100 | 20.0 / 20.0 / 12.0 / 20.0 | 10.0 / 5.00 / 12.0 / 10.0" \
        in page
    assert "| 2.00× (tilelang) / 4.00× (tilelang) |" in page
    assert "| 2 q4 |" in page and "skipped | FAIL |" in page
    assert "- plain, GPU time: the faster of our backends faster than the baseline on 2 of 2 cases, geometric " \
           "mean 3.00×." in page
    assert "- tilelang: host time per call over the torch launch timed beside it 1.50-1.50×" in page
    assert "(relative L2 error at most 0.02)" in page and "10 of 11 timed results passed; failed:\n- 2 q4 triton: " \
        "relative error nan" in page
    per_row = _page_run()
    del per_row["settings"]["rel_err_threshold"]  # runs since the per-row bound: the notes state it
    assert "(the bound the notes give)" in report.markdown(per_row)
    assert "- tilelang on 2 q4: no q4 here" in page
    assert "| case | plain µs | q4 |\n|---|---|---|\n| 1 | 5.00 | 1.20 |\n" in page  # 6 over 5 us; case 2: none
    assert page.endswith("```\n")


def test_markdown_machine_lines_are_those_of_the_run(fake_run):
    assert report.machine_lines_of(report.run_to_dict(fake_run)) == report.machine_lines(fake_run)


def test_markdown_is_written_by_the_bench_and_from_a_json(fake_run, tmp_path, capsys):
    report.write_markdown(fake_run, tmp_path / "run.md")
    report.write_json(fake_run, tmp_path / "run.json")
    report.main([str(tmp_path / "run.json")])
    assert capsys.readouterr().out == (tmp_path / "run.md").read_text()


@pytest.mark.parametrize("content, message", [
    (None, "no run at"), ("{", "is no JSON"), ('{"rows": []}', "is no run of flashdecode bench --json"),
])
def test_the_report_names_a_file_that_is_no_run(tmp_path, capsys, content, message):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit):
        report.main([str(path)])
    assert message in capsys.readouterr().err


def test_runs_of_other_cases_merge_into_one_page(fake_run, tmp_path, capsys):
    whole = report.run_to_dict(fake_run)
    variants = ["variant paged1: pages of 1 token", "variant paged4: pages of 4 tokens"]
    first = {**whole, "cases": whole["cases"][:2],
             "notes": [*whole["notes"], *variants, "one launch takes 4.3 us here", "partial: 2 of 3 case runs"]}
    second = {**whole, "cases": whole["cases"][2:], "date": "2026-11-30T00:00:00+00:00", "git_commit": "def",
              "ceiling": {**whole["ceiling"], "gbps": 4000.0},
              "settings": {**whole["settings"], "torch_launch_us": 5.0},
              "notes": [*whole["notes"], *variants, "one launch takes 5.0 us here", "a second part's own note"]}
    for name, part in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(part))
    report.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(tmp_path / "run.json")])
    merged = json.loads((tmp_path / "run.json").read_text())
    assert capsys.readouterr().out == report.markdown(merged)
    assert merged["cases"] == whole["cases"] and merged["ceiling"] == whole["ceiling"]
    assert merged["settings"]["torch_launch_us"] == 4.25 and merged["date"] == whole["date"]
    # a note both parts have once, notes that differ (if only in a figure) each; each part told in the last
    assert merged["notes"][:-1] == [*whole["notes"], *variants, "one launch takes 4.3 us here",
                                    "one launch takes 5.0 us here", "a second part's own note"]
    assert merged["notes"][-1] == (
        "merged from 2 runs (fractions of the ceiling are each run's own): cases 1, 2: run of "
        "2026-11-29T00:00:00+00:00 at commit abc, ceiling 4295 GB/s, one torch launch 4.25 µs of host time, - µs of "
        "GPU time (partial: 2 of 3 case runs); cases W3: run of 2026-11-30T00:00:00+00:00 at commit def, ceiling "
        "4000 GB/s, one torch launch 5.00 µs of host time, - µs of GPU time")


@pytest.mark.parametrize("change, message", [
    ({"device": "Other GPU"}, "run 2 has another device than run 1"),
    ({"source_digest": "other"}, "run 2 has another source_digest than run 1"),
    ({"settings": {"iters": 50, "torch_launch_us": 4.25}}, "run 2 has other settings than run 1: iters"),
    ({}, "case 1 plain (cases) is in two runs"),
])
def test_runs_that_do_not_merge_say_why(fake_run, change, message):
    whole = report.run_to_dict(fake_run)
    with pytest.raises(ValueError, match=re.escape(message)):
        report.merge_runs([whole, {**whole, **change}])


@pytest.mark.parametrize("name", ["benchmarks", "benchmarks-serving"])
def test_docs_benchmark_pages_are_their_committed_runs_pages(name):
    docs = pathlib.Path(__file__).parent.parent / "docs"
    assert (docs / f"{name}.md").read_text() == report.markdown(json.loads((docs / f"{name}.json").read_text()))


def test_every_data_file_is_in_the_data_index():
    """docs/data/README.md names each raw file (``{a,b}`` for a few at once): a file no document
    points to is not kept, and one the index does not name is found only by chance."""
    data = pathlib.Path(__file__).parent.parent / "docs" / "data"
    named = set()
    for spelled in re.findall(r"`([^`]+)`", (data / "README.md").read_text()):
        expanded = [spelled]
        while any("{" in name for name in expanded):
            expanded = [name[:name.index("{")] + choice + name[name.index("}") + 1:] for name in expanded
                        for choice in name[name.index("{") + 1:name.index("}")].split(",")]
        named.update(name.rstrip("/") for name in expanded)
    files = {path.name for path in data.iterdir() if path.is_file() and path.name != "README.md"}
    profiles = {f"profiles/{path.name}" for path in (data / "profiles").iterdir()}
    assert sorted(files - named) == [] and sorted(profiles - named) == []


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

@pytest.mark.slow
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


# --- provenance -----------------------------------------------------------------------------------

def test_git_commit_marks_uncommitted_changes(tmp_path, monkeypatch):
    """A run from a modified checkout must not claim a clean commit: the hash gets "-dirty"."""
    import flashdecode
    from flashdecode.bench import provenance

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
    clean = provenance.git_commit()
    assert clean is not None and len(clean) == 40
    (package / "__init__.py").write_text("x = 2\n")
    assert provenance.git_commit() == clean + "-dirty"


def test_source_digest_names_the_code_not_the_checkout(tmp_path, monkeypatch):
    """The digest changes with any package source and with nothing else (it needs no git)."""
    import flashdecode
    from flashdecode.bench import provenance

    package = tmp_path / "flashdecode"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (package / "sub" / "k.py").write_text("y = 1\n")
    monkeypatch.setattr(flashdecode, "__file__", str(package / "__init__.py"))
    first = provenance.source_digest()
    assert len(first) == 12 and provenance.source_digest() == first
    (tmp_path / "notes.txt").write_text("outside the package")
    assert provenance.source_digest() == first
    (package / "sub" / "k.py").write_text("y = 2\n")
    assert provenance.source_digest() != first
    (package / "csrc").mkdir()
    (package / "csrc" / "host_path.cpp").write_text("int x;\n")
    extension, python = provenance.extension_digest(), provenance.source_digest()
    (package / "csrc" / "host_path.cpp").write_text("int y;\n")
    assert provenance.extension_digest() != extension and provenance.source_digest() == python


# --- tools/build_fa2.py -------------------------------------------------------------------------

def tool_script(name: str):
    """``tools/<name>.py`` imported as a module (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def build_fa2():
    return tool_script("build_fa2")


def test_fa2_build_selects_forward_kernels_of_three_head_dims(build_fa2):
    sources = build_fa2.kernel_sources()
    assert len(sources) == len(set(sources)) == 24
    assert "csrc/flash_attn/src/flash_fwd_split_hdim128_bf16_causal_sm80.cu" in sources
    assert "csrc/flash_attn/src/flash_fwd_hdim64_fp16_sm80.cu" in sources
    assert not any("bwd" in name or "hdim32" in name or "hdim192" in name for name in sources)
    assert build_fa2.ARCH == ("-gencode", "arch=compute_90,code=sm_90")
    assert "-DFLASHATTENTION_DISABLE_DROPOUT" in build_fa2.defines()


def _fake_sdist(build_fa2, path):
    """A tarball shaped like FlashAttention's sdist: the selected kernels and their headers, plus files
    nothing includes (a backward kernel, an unused CUTLASS header)."""
    static_switch = ("#define HEADDIM_SWITCH(HEADDIM, ...) \\\n" + "".join(
        f"  constexpr static int kHeadDim = {d}; \\\n" for d in (32, 64, 96, 128, 192, 256)))
    files = {
        build_fa2.API: b'#include "flash.h"\n#include "static_switch.h"\n#include <torch/python.h>\n',
        "csrc/flash_attn/src/flash.h": b'#include "namespace_config.h"\n#include <cuda.h>\n',
        "csrc/flash_attn/src/namespace_config.h": b"",
        "csrc/flash_attn/src/static_switch.h": static_switch.encode(),
        "csrc/flash_attn/src/flash_fwd_launch_template.h": b'#include "flash.h"\n  # include <cute/tensor.hpp>\n',
        "csrc/flash_attn/src/flash_bwd_hdim128_bf16_sm80.cu": b'#include "flash_bwd_launch_template.h"\n',
        "csrc/flash_attn/src/flash_bwd_launch_template.h": b"",
        "csrc/cutlass/include/cute/tensor.hpp": b'#include "cute/layout.hpp"\n#include <cutlass/numeric_types.h>\n',
        "csrc/cutlass/include/cute/layout.hpp": b"",
        "csrc/cutlass/include/cutlass/numeric_types.h": b"",
        "csrc/cutlass/include/cutlass/unused.h": b"",
        "flash_attn/__init__.py": b'__version__ = "2.8.3"\n',
        "flash_attn/flash_attn_interface.py": b"import flash_attn_2_cuda\n",
        "flash_attn/bert_padding.py": b"from einops import rearrange\n",
        "flash_attn/layers/rotary.py": b"",
        "LICENSE": b"BSD",
    }
    for name in build_fa2.kernel_sources():
        files[name] = b'#include "namespace_config.h"\n#include "flash_fwd_launch_template.h"\n'
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(f"flash_attn-2.8.3/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return files


def test_fa2_prepare_packs_only_what_the_build_includes(build_fa2, tmp_path):
    files = _fake_sdist(build_fa2, tmp_path / "sdist.tar.gz")
    chosen = build_fa2.prepare(tmp_path / "sdist.tar.gz", tmp_path / "src.tar.xz")
    left_out = {"csrc/flash_attn/src/flash_bwd_hdim128_bf16_sm80.cu", "csrc/flash_attn/src/flash_bwd_launch_template.h",
                "csrc/cutlass/include/cutlass/unused.h", "flash_attn/layers/rotary.py"}
    assert set(chosen) == set(files) - left_out
    src = build_fa2.unpack(tmp_path / "src.tar.xz", tmp_path / "work")
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()) == sorted(chosen)
    assert (src / "csrc/cutlass/include/cute/layout.hpp").exists()  # found beside the file including it
    assert build_fa2.flash_attn_version(src) == "2.8.3"
    with pytest.raises(FileNotFoundError, match="missing.h"):
        build_fa2.include_closure({"a.cu": b'#include "missing.h"\n'} | {"b.h": b""}, ["a.cu", "missing.h"])


def test_fa2_unbuilt_kernels_are_defined_as_errors(build_fa2):
    headdims = build_fa2.switch_headdims("#define BOOL_SWITCH kHeadDim = 7;\n#define HEADDIM_SWITCH(H) \\\n"
                                         "  kHeadDim = 32; kHeadDim = 64; kHeadDim = 96; kHeadDim = 128; "
                                         "kHeadDim = 192; kHeadDim = 256;")
    assert headdims == [32, 64, 96, 128, 192, 256]
    source = build_fa2.unbuilt_kernels_source(headdims)
    assert source.count("template<>") == 2 * 6 * 2 + 2 * 3 * 2 * 2  # every backward; forward of 32, 96, 192
    assert "run_mha_bwd_<cutlass::bfloat16_t, 128, true>(Flash_bwd_params &" in source
    assert "run_mha_fwd_splitkv_dispatch<cutlass::half_t, 96, false>(Flash_fwd_params &" in source
    assert "run_mha_fwd_<cutlass::half_t, 128," not in source and "TORCH_CHECK(false" in source


def test_grid_coverage_names_a_condensed_log(tmp_path, capsys, monkeypatch):
    """docs/data's GPU-test logs keep verdict counts, not verdicts: tools/fa_grid_coverage.py says so
    rather than report those runs as one combo."""
    log = tmp_path / "gpu_tests.log"
    log.write_text("    335 tests/test_fa_kvcache.py PASSED\n")
    monkeypatch.setattr(sys, "argv", ["fa_grid_coverage.py", str(log)])
    assert tool_script("fa_grid_coverage").main() == 1  # and nothing to report
    assert f"{log}: 0 verdicts read, 335 counted: a condensed log" in capsys.readouterr().err


def test_ptx_comparison_exits_one_unless_every_file_is_the_same(tmp_path, capsys, monkeypatch):
    """tools/triton_ptx.py --compare (and tilelang_source.py's) is a check a script can rely on."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    print_comparison = tool_script("triton_ptx").print_comparison
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for folder in (mine, theirs):
        folder.mkdir()
        (folder / "a.ptx").write_text("add.f32")
    assert print_comparison(mine, theirs) == 0 and capsys.readouterr().out == "a.ptx: same\n"
    (theirs / "a.ptx").write_text("mul.f32")
    assert print_comparison(mine, theirs) == 1 and "a.ptx: differs" in capsys.readouterr().out
    (theirs / "a.ptx").unlink()
    assert print_comparison(mine, theirs) == 1 and f"a.ptx: only in {mine}" in capsys.readouterr().out
    assert print_comparison(mine, tmp_path / "gone") == 1 and "no folder at" in capsys.readouterr().err


@pytest.mark.parametrize("product", ["HMMA.16816.F32", "HGMMA.64x64x16.F32.BF16", "QGMMA.64x16x32.F32.E4M3.E4M3"])
def test_fp8_sass_main_loop_holds_a_tensor_core_product_of_either_kind(product):
    """The main loop is the largest loop holding mma.sync or wgmma (64-row tiles take HGMMA: its
    counts read 0 when only HMMA was looked for)."""
    main_loop = tool_script("fp8_sass").main_loop
    lines = [(0x00, "MOV R1, c[0x0][0x28]"), (0x10, "LDS.64 R2, [R3]"), (0x20, product), (0x30, "BRA 0x10"),
             (0x40, "ISETP.GE.AND P0, PT, R4, R5, PT"), (0x50, "BRA 0x40"), (0x60, "EXIT")]
    assert [address for address, _ in main_loop(lines)] == [0x10, 0x20, 0x30]


# --- tools/summary_table.py ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def summary_table():
    return tool_script("summary_table")


def _bounded_run(floor_us):
    """1e6 bytes per us of ceiling; a big case FA2 reads at half of it, a tiny one FA2 runs in 2 floors,
    and cases the headroom must pass over: a variant, and FA2 wrong."""
    def case(bytes_, fa2_graph, variant="plain", correct=True):
        return {"variant": variant, "bytes": bytes_,
                "results": {"fa2": {"correct": correct, "graph_us": fa2_graph}, "triton": {"graph_us": 1.0}}}
    return {"settings": {"torch_launch_gpu_us": floor_us}, "ceiling": {"gbps": 1000.0},
            "cases": [case(100e6, 200.0), case(1e3, 10.0), case(1e3, 1000.0, variant="q4"),
                      case(100e6, 1.0, correct=False)]}


def test_headroom_bounds_every_case_by_the_ceiling_and_one_launch(summary_table):
    bounds = summary_table.headroom(_bounded_run(5.0), fractions=(1.0, 0.5))
    assert bounds[1.0] == pytest.approx(2.0)  # 200 / 100 us at the ceiling, 10 / 5 us at the floor
    assert bounds[0.5] == pytest.approx(math.sqrt(2.0))  # the big case at 200 us: level with FA2
    assert summary_table.headroom(_bounded_run(None)) == {}


def test_variants_over_plain_compare_runs_of_one_device_only(summary_table, capsys):
    """A variant's GPU time over another GPU's plain call is no ratio (an H100's fp8 over an H200's
    plain call read 0.80-0.87); a run without variants prints no table."""
    def run(device, variants):
        return {"device": device, "settings": {"variants": variants}, "cases": [
            {"case": 7, "variant": name, "results": {"triton": {"correct": True, "graph_us": graph}}}
            for name, graph in zip(variants, (100.0, 60.0))]}
    summary_table.print_against_plain(run("NVIDIA H100", ["plain", "fp8"]), run("NVIDIA H100", ["plain"]))
    assert "| 7 | 100.0 | 0.60 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--plain: its run is an NVIDIA H200's and this one an NVIDIA H100's"):
        summary_table.check_same_device(run("NVIDIA H100", ["plain", "fp8"]), run("NVIDIA H200", ["plain"]))
    summary_table.print_against_plain(run("NVIDIA H100", ["plain"]), run("NVIDIA H100", ["plain"]))
    assert capsys.readouterr().out == ""


# --- the candidates log ---------------------------------------------------------------------------

def _record(case, runtime_ms, day, technique="triton split(block_n=64)", validation="pass", device="H200"):
    return {"case": case, "device": device, "timestamp": f"2026-12-{day:02d}T00:00:00+00:00", "git_commit": "c0ffee",
            "technique": technique, "validation": validation, "runtime_ms": runtime_ms, "speedup": 1.0}


def test_technique_names_backend_kernel_config_and_flags():
    plan = {"kernel": "split", "config": {"block_n": 64, "num_warps": 4, "merge_step": None},
            "programs_per_head": 57, "merge_in_split": False, "dependent_combine": True}
    assert candidates.technique("triton", plan) == "triton split(block_n=64, num_warps=4) +dependent_combine"
    assert candidates.technique("tilelang", None) == "tilelang"


def test_rank_orders_techniques_per_case_by_their_best_passing_runtime():
    found = [_record(10, 0.020, 1, "a"), _record(10, 0.016, 2, "b"), _record(10, 0.018, 3, "a"),
             _record(10, 0.001, 4, "c", validation="fail"), _record(10, 0.030, 1, "a", device="C500"),
             _record("10/q4", 0.050, 1, "a")]
    h200, c500, q4 = candidates.rank(found)
    assert (h200.device, h200.case, c500.device, q4.case) == ("H200", 10, "C500", "10/q4")
    assert [(t.technique, t.best["runtime_ms"], t.candidates) for t in h200.techniques] == [
        ("b", 0.016, 1), ("a", 0.018, 2)]
    assert (h200.candidates, h200.failed) == (3, 1)
    assert "1. " in candidates.format_rankings([h200], top=1) and "a" not in \
        candidates.format_rankings([h200], top=1).split("b")[-1]


@pytest.mark.parametrize("case, command", [
    (7, "flashdecode profile --case 7"), ("7/q4", "flashdecode profile --case 7 --variant q4"),
    ("W8/paged16", "flashdecode profile --case W8 --variant paged16"), ("M1", "flashdecode profile --case M1"),
    ("16x2048x1x71x64:uniform/q4", "flashdecode profile --shape 16x2048x1x71x64:uniform --variant q4"),
])
def test_the_next_steps_name_a_profile_command_that_parses(case, command):
    """The profile command a stagnating case's advice names takes the log's case as it is."""
    from flashdecode.profile import shape

    assert candidates.profile_command(case) == command
    parser = argparse.ArgumentParser()
    shape.add_arguments(parser)
    named = shape.from_args(parser.parse_args(command.split()[2:]))
    label = str(case).split("/")[0]
    assert (named.case.label if named.case.number else named.case.spelling) == label


def test_a_shape_named_by_its_runs_label_gets_no_profile_command():
    """A log from before shapes were named by their spelling says "S1": any command would guess."""
    advice = candidates.profile_command("S1/q4")
    assert "--from-runs" in advice and "--shape" not in advice


def test_the_log_names_a_shape_of_ones_own_by_its_spelling_not_its_label():
    """S1 is each run's first --shapes item: two runs' S1 of other shapes are two cases of the log, and
    one shape keeps its name whatever its place on the command line."""
    def run(date, *spellings):  # as a run without CUDA records it: "shape" scaled down, "matrix_shape" as given
        shapes = cases.parse_shapes(",".join(spellings))
        return {"date": date, "device": "H200", "cases": [
            {"case": case.label, "matrix": "shapes", "variant": "plain", "matrix_shape": dataclasses.asdict(case),
             "shape": {**dataclasses.asdict(case), "seqlen_cache": 8},
             "results": {"triton": {"kind": "ours", "median_us": 10.0, "correct": True,
                                    "plan": {"kernel": "split"}}}} for case in shapes]}

    first = candidates.records(run("2026-12-01", "1x2048x8x4x128:equal"))
    second = candidates.records(run("2026-12-02", "1x32768x1x8x128:equal", "1x2048x8x4x128:equal"))
    assert [r["case"] for r in first + second] == ["1x2048x8x4x128:equal", "1x32768x1x8x128:equal",
                                                   "1x2048x8x4x128:equal"]
    assert [(r.case, r.candidates) for r in candidates.rank(first + second)] == [
        ("1x2048x8x4x128:equal", 2), ("1x32768x1x8x128:equal", 1)]


def test_a_case_stagnates_after_three_candidates_without_a_one_percent_gain():
    improving = [_record(7, runtime, day) for day, runtime in enumerate((0.100, 0.090, 0.080, 0.070), start=1)]
    assert not candidates.rank(improving)[0].stagnating
    flat = [_record(7, runtime, day) for day, runtime in enumerate((0.100, 0.080, 0.0795, 0.081, 0.0799), start=1)]
    ranking = candidates.rank(flat)[0]
    assert ranking.since_gain == 3 and ranking.stagnating and ranking.last_gain["runtime_ms"] == 0.080
    text = candidates.format_rankings([ranking], top=5)
    assert "STAGNATING: 3 candidates since the last gain (2026-12-02, 80.00 us)" in text
    assert "flashdecode profile --case 7" in text and "A-M" in text and "docs/patterns/" in text
    assert not candidates.rank(flat, stall=4)[0].stagnating


def test_records_rebuild_from_run_json_files(fake_run, tmp_path):
    """A run's JSON gives the records its live run appends; runs whose plans lack the kernel are left out."""
    report.write_json(fake_run, tmp_path / "run.json")
    old = json.loads((tmp_path / "run.json").read_text())
    for case in old["cases"]:
        for result in case["results"].values():
            if result.get("plan"):
                result["plan"] = {"block_n": 64}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "other.json").write_text("[]")
    found, left_out = candidates.from_runs([tmp_path / "run.json", tmp_path / "old.json", tmp_path / "other.json",
                                            tmp_path / "run.json"])
    assert found == report.candidate_records(fake_run)
    assert [reason.split(": ", 1)[1] for reason in left_out] == ["its plans do not name their kernel",
                                                                 "not a bench run"]
    candidates.write(found, tmp_path / "log" / "candidates.jsonl")
    assert candidates.read(tmp_path / "log" / "candidates.jsonl") == found


def test_sinks_and_ragged_variants(runner):
    """sinks: a logit per head; ragged: drafts of 1-8 tokens per sequence, packed by
    cu_seqlens_q and appended; ragged-per-length computes the same rows in one call per length into
    one out; ragged-padded gives every sequence ceil(drafts / batch) rows. No peer takes the first two."""
    shape = cases.Case(0, 5, 40, 2, 4, 64, "uniform")
    sinks = cases.make_call(shape, cases.VARIANTS["sinks"], dtype=torch.float32)
    assert sinks.sinks.shape == (shape.nheads,) and sinks.kwargs()["sinks"] is sinks.sinks
    ragged = cases.make_call(shape, cases.VARIANTS["ragged"], dtype=torch.float16)  # the public call's dtype
    drafts = ragged.cu_seqlens_q.diff().tolist()
    assert 1 <= min(drafts) and max(drafts) <= 8 and ragged.max_seqlen_q == 8
    assert ragged.q.shape == (sum(drafts), shape.nheads, 64) and ragged.k.shape == (sum(drafts), shape.nheads_k, 64)
    assert [length - cached for length, cached in zip(ragged.lengths, ragged.cache_seqlens.tolist())] == drafts
    expected = _reference(ragged)
    per_length = cases.make_call(shape, cases.VARIANTS["ragged-per-length"], dtype=torch.float16)
    runs = [draft for draft, _ in itertools.groupby(drafts)]  # a part per run of one length
    assert torch.equal(per_length.q, ragged.q) and [part.q.shape[1] for part in per_length.parts] == runs
    check, setup, *_ = runner.call_ours("reference")
    assert check(per_length)["kernel"] == "single_pass"
    out = setup([per_length])[0]()
    assert out is per_length.out and relative_error(out, expected) < 1e-3
    padded = cases.make_call(shape, cases.VARIANTS["ragged-padded"], dtype=torch.float32)
    assert padded.q.shape == (5, -(-sum(drafts) // 5), shape.nheads, 64) and padded.cu_seqlens_q is None
    for call in (sinks, ragged):
        with pytest.raises(Unsupported, match="no peer takes them"):
            runner._peer_check(lambda call: None)(call)


# --- tools/sweep.py -----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "fp8", "paged16", "q4"])
def test_sweep_packed_heads_are_the_same_attention(variant):
    """``--pack-heads``: adjacent KV heads viewed as one, each query head zero-padded outside its own
    head's dims, give every query head its own attention once unpacked (case 5: 4 KV heads of 8)."""
    sweep = tool_script("sweep")
    inputs = cases.make_call(cases.CASES_BY_NUMBER[5], cases.VARIANTS[variant])
    want = reference_attention(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs())[0]
    q, k_cache, v_cache, kwargs, unpack = sweep.pack_heads(inputs, 2)
    assert k_cache.shape[-2:] == v_cache.shape[-2:] == (2, 256) and q.shape[-2:] == (32, 256)
    assert relative_error(unpack(reference_attention(q, k_cache, v_cache, **kwargs)[0]), want) < 1e-6


@pytest.mark.parametrize("variant, heads", [("append", 2), ("ragged", 2), ("plain", 3), ("plain", 4)])
def test_sweep_packed_heads_name_what_they_cannot_pack(variant, heads):
    """Appended tokens, ragged rows, KV heads not a multiple of the packing, or a packed head past 256."""
    sweep = tool_script("sweep")
    inputs = cases.make_call(cases.CASES_BY_NUMBER[5], cases.VARIANTS[variant])
    with pytest.raises(ValueError, match=f"--pack-heads {heads}: needs"):
        sweep.pack_heads(inputs, heads)


def test_prewarm_calls_every_shape_the_benchmark_draws(monkeypatch, capsys):
    """tools/prewarm.py: a ragged variant's seeds give each set of drafts the benchmark's timed, fresh
    and layer inputs draw, once; another variant's calls have one shape (one seed). A call runs with
    and without lse, a call of parts each part without, as the benchmark runs them (Triton's
    interpreter here); a call that fails is reported and the rest go on."""
    from flashdecode.bench import runner

    monkeypatch.setattr(sys, "path", ["tools", *sys.path])
    import prewarm

    case, ragged = cases.CASES_BY_LABEL["4"], cases.VARIANTS["ragged-per-length"]
    drawn = [runner.TIMED_SEED, runner.FRESH_SEED, *runner.layer_seeds(runner.EAGER_LAYERS)]
    every = {tuple(cases.draft_lengths(case, ragged, seed)) for seed in drawn}
    kept = prewarm.seeds(case, ragged)
    assert len(kept) == len(every) > 1 and {tuple(cases.draft_lengths(case, ragged, seed)) for seed in kept} == every
    assert prewarm.seeds(case, cases.VARIANTS["fp8"]) == [runner.TIMED_SEED]
    small, _ = runner.as_run(cases.CASES_BY_LABEL["3"], cuda=False)
    parts = sum(len(cases.make_call(small, ragged, seed=seed).parts) for seed in prewarm.seeds(small, ragged))
    assert prewarm.warm((cases.CASES_BY_LABEL["3"], "ragged-per-length", ("triton",))) == (parts, [], [])
    assert prewarm.main(["--cases", "3", "--variant", "plain", "--jobs", "1"]) == 0
    assert "prewarm: 2 calls over 1 (case, variant)" in capsys.readouterr().out

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(prewarm.flashdecode, "flash_attn_with_kvcache", broken)
    made, refused, failed = prewarm.warm((cases.CASES_BY_LABEL["3"], "plain", ("triton",)))
    assert (made, refused, failed) == (0, [], ["case 3 plain triton: RuntimeError: no such kernel"])
