"""FlashAttention's ``test_flash_attn_kvcache`` grid against the public call (``tests/fa_grid.py``
says what is checked and where it departs from FlashAttention's list).

CPU tiers: a seeded sample of 32 float16 combos with seqlen_k <= 1024, 8 (seqlen_k <= 800) of the fp8
part of the grid (``fa_grid.FP8_AXES``: fp8 caches x softcap over every other axis), and one combo of
each part of the extension axes (``fa_grid.extension_sample``: sinks at each split count, ragged
queries at each pair of causal and new k/v), each for the "reference" backend and for "triton"
(under its interpreter without CUDA; bfloat16 is wrong there); 3 of the 32, one fp8 combo and the
extension combos in the fast tier, the rest ``slow``.
GPU tier (``gpu`` marker): "triton" and "tilelang", float16 and bfloat16, on FLASHDECODE_FA_GRID=
"sample" (default: 240 combos stratified over pairs of features), N (that many) or "full" (all
506,880 combos per backend: about a million tests, hours), plus FLASHDECODE_FA_GRID_FP8 combos of the
fp8 part (default 80; "full" is not drawn there). FLASHDECODE_FA_GRID_SEED (default 2025)
draws another sample, so that runs cut by a time limit cover new combos, not the same first ones;
a smaller ``fa_grid.sample`` of a seed is the start of a larger one.
The extension axes' GPU tier: "triton", "auto" and "tilelang" on FLASHDECODE_FA_GRID_EXTENSION combos
of each part (default 8; TileLang takes sinks, not ragged queries: those combos are skipped).
Two more GPU tiers on the part of the grid TileLang implements: "tilelang" on its own sample
(FLASHDECODE_FA_GRID_TILELANG combos, default 30, or "full") and ``backend="auto"`` on another
(FLASHDECODE_FA_GRID_AUTO, default 30), what a user's call runs.
The defaults are sized for one session's device time: with 14 pytest-xdist workers on an H100
(2026-12-06) a grid test took about 0.7 s of wall time (738 in 520 s) and the tests outside the
grid 703 took ~475 s (82% in 390 s), so the 844 grid tests of the defaults made an estimated
~1,100 s tier. Measured at 9078e8b (2026-12-06, the same card and workers), a third of the tier
(``FLASHDECODE_TEST_SHARD=0/3``, 502 tests) ran 501 in 540 s and the next (517) 407 in 470 s: the
tier is ~1,700 s, four shards (``I/4``) of one call each. The
earlier defaults (2000 + 400 combos, 40 and 60 + 60 a part) made about 6,300 tests, whose first
third ran 35% in 520 s; FLASHDECODE_FA_GRID=2000 FLASHDECODE_FA_GRID_FP8=400
FLASHDECODE_FA_GRID_EXTENSION=40 FLASHDECODE_FA_GRID_TILELANG=60 FLASHDECODE_FA_GRID_AUTO=60 run them.
A backend that cannot take a combo raises
BackendError: that combo is skipped with its message.
With FLASHDECODE_FA_GRID_REPORT=PATH, pass/fail/skip counts per tier, backend, dtype and feature
are written there as JSON every few seconds and at the end (a file per pytest-xdist worker, merged
by ``fa_grid.merge_reports``).
Under pytest-xdist, combos with caches of 16k tokens or more run one at a time (a file lock), so
parallel workers do not run one GPU out of memory.
"""
import contextlib
import dataclasses
import fcntl
import json
import os
import tempfile
import threading
import time

import pytest
import torch

import fa_grid
import flashdecode
from conftest import HAS_CUDA, slow_except
from flashdecode.kernels.base import BackendError

DEVICE = "cuda" if HAS_CUDA else "cpu"
CPU_COMBOS = fa_grid.sample(32, seed=2024, dtypes=("float16",), max_seqlen_k=1024)
GRID_SIZE = os.environ.get("FLASHDECODE_FA_GRID", "sample")
GRID_SEED = int(os.environ.get("FLASHDECODE_FA_GRID_SEED", "2025"))
if GRID_SIZE not in ("sample", "full") and not GRID_SIZE.isdigit():
    raise ValueError(f"FLASHDECODE_FA_GRID must be 'sample', 'full' or a number of sampled combos, got {GRID_SIZE!r}")
CPU_FP8_COMBOS = fa_grid.sample(8, seed=2340, dtypes=("float16",), max_seqlen_k=800, restrict=fa_grid.FP8_AXES)
#: The GPU tier's default draws: of the grid, of its fp8 part, of each extension part, of TileLang's
#: part for "tilelang" and for "auto" (the docstring says why these sizes).
GPU_SAMPLE, GPU_FP8_SAMPLE, GPU_EXTENSION_SAMPLE, GPU_PART_SAMPLE = 240, 80, 8, 30
#: Drawn only where CUDA is (a CPU run deselects the gpu tier; a draw of thousands takes seconds).
GPU_COMBOS = [] if not HAS_CUDA else (fa_grid.full_grid() if GRID_SIZE == "full" else
                                      fa_grid.sample(GPU_SAMPLE if GRID_SIZE == "sample" else int(GRID_SIZE),
                                                     seed=GRID_SEED)) + \
    fa_grid.sample(int(os.environ.get("FLASHDECODE_FA_GRID_FP8", GPU_FP8_SAMPLE)), seed=GRID_SEED + 3,
                   restrict=fa_grid.FP8_AXES)
#: The part of the grid the TileLang kernels implement (no rotary, ALiBi or cache_batch_idx; head dims
#: 64, 128, 256), without cache_leftpad (which they take too: the whole grid's sample runs it there);
#: query rows over its q tile are still skipped. Its own
#: sample (FLASHDECODE_FA_GRID_TILELANG combos, default 30), as the whole grid's sample holds few.
TILELANG_AXES = {"d": (64, 128, 256), "alibi": (False,), "rotary_fraction": (0.0,), "rotary_interleaved": (False,),
                 "has_leftpad": (False,), "has_batch_idx": (False,),
                 "seqlens": tuple(pair for pair in fa_grid.SEQLEN_PAIRS if pair[0] <= 16)}


def part_combos(variable, default, seed):
    """TileLang's part of the grid: a sample of ``variable`` combos (default ``default``), or all
    of its distinct combos for "full" (6,048, 5,472 within its query rows: runs pick theirs by test id)."""
    size = os.environ.get(variable, str(default))
    if size == "full":
        return fa_grid.distinct(fa_grid.full_grid(restrict=TILELANG_AXES))
    if not size.isdigit():
        raise ValueError(f"{variable} must be 'full' or a number of sampled combos, got {size!r}")
    return fa_grid.sample(int(size), seed=seed, restrict=TILELANG_AXES)


CPU_EXTENSION_COMBOS = fa_grid.extension_sample(1, seed=2026, dtypes=("float16",), max_seqlen_k=339)
GPU_EXTENSION_COMBOS = fa_grid.extension_sample(int(os.environ.get("FLASHDECODE_FA_GRID_EXTENSION", GPU_EXTENSION_SAMPLE)),
                                                seed=GRID_SEED + 3)
TILELANG_COMBOS = part_combos("FLASHDECODE_FA_GRID_TILELANG", GPU_PART_SAMPLE, GRID_SEED + 1)
#: What a user gets: the same part of the grid through ``backend="auto"`` (FLASHDECODE_FA_GRID_AUTO
#: combos, default 30). On Hopper it sends head dim 256 and small plain caches to TileLang and the
#: rest to Triton, so this tier checks the route as well as the kernels.
AUTO_COMBOS = part_combos("FLASHDECODE_FA_GRID_AUTO", GPU_PART_SAMPLE, GRID_SEED + 2)


def _report_path():
    """FLASHDECODE_FA_GRID_REPORT, one file per pytest-xdist worker (``.gw0``, ...; ``fa_grid.merge_reports``)."""
    path = os.environ.get("FLASHDECODE_FA_GRID_REPORT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{path}.{worker}" if path and worker else path


REPORT = fa_grid.GridReport(_report_path())


@pytest.fixture(scope="module", autouse=True)
def write_report():
    yield
    REPORT.flush()


def public_call(backend):
    """flashdecode.flash_attn_with_kvcache with ``backend``; a combo it cannot take is skipped."""
    def call(**arguments):
        try:
            return flashdecode.flash_attn_with_kvcache(**arguments, backend=backend)
        except BackendError as error:
            pytest.skip(f"{backend}: {error}")
    return call


#: Combos with caches of at least this many tokens run one at a time across pytest-xdist workers:
#: their inputs and float32 references take up to ~20 GB, and 12 workers sharing one H200 ran it
#: out of memory (59 of 644 combos on 2026-12-01).
LARGE_SEQLEN_K = 16384
LARGE_COMBO_LOCK = os.path.join(tempfile.gettempdir(), "flashdecode-fa-grid-large.lock")


@contextlib.contextmanager
def one_large_combo_at_a_time(combo):
    """Under pytest-xdist, a combo of LARGE_SEQLEN_K tokens or more holds a file lock while it runs
    and gives its cached GPU memory back before releasing it; other combos run freely."""
    if combo.seqlens[1] < LARGE_SEQLEN_K or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with open(LARGE_COMBO_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if HAS_CUDA:
                torch.cuda.empty_cache()
            fcntl.flock(handle, fcntl.LOCK_UN)


def run(tier, backend, combo):
    with one_large_combo_at_a_time(combo), REPORT.recording(tier, backend, combo):
        fa_grid.check_combo(combo, DEVICE, public_call(backend))


#: The fast tier's combos (append, rotary both ways, ALiBi, windows, left pad, pages; one fp8);
#: ``-m slow`` runs the rest: every combo on the reference, every other one on Triton's interpreter
#: (10-30 s a combo on 2 cores; the GPU tier runs thousands).
FAST_COMBOS = {CPU_COMBOS[8], CPU_COMBOS[21], CPU_COMBOS[29], CPU_FP8_COMBOS[0]}
SAMPLE_RUNS = [(backend, combo) for index, combo in enumerate(CPU_COMBOS + CPU_FP8_COMBOS)
               for backend in ("reference", "triton") if backend == "reference" or index % 2 == 0
               or combo in FAST_COMBOS]


@pytest.mark.parametrize("backend, combo", slow_except(SAMPLE_RUNS, {("triton", combo) for combo in FAST_COMBOS} |
                                                       {("reference", combo) for combo in FAST_COMBOS}, several=True),
                         ids=[f"{backend}-{combo.id}" for backend, combo in SAMPLE_RUNS])
def test_kvcache_grid_sample(backend, combo):
    run("cpu", backend, combo)


@pytest.mark.parametrize("combo", CPU_EXTENSION_COMBOS, ids=lambda combo: combo.id)
@pytest.mark.parametrize("backend", slow_except(["reference", "triton"], ["reference"]))
def test_kvcache_grid_extension_sample(backend, combo):
    run("cpu-extension", backend, combo)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", GPU_EXTENSION_COMBOS, ids=lambda combo: combo.id)
@pytest.mark.parametrize("backend", ["triton", "auto", "tilelang"])
def test_kvcache_grid_extension_gpu(backend, combo):
    run("gpu-extension", backend, combo)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", GPU_COMBOS, ids=lambda combo: combo.id)
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_kvcache_grid_gpu(backend, combo):
    run("gpu", backend, combo)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", TILELANG_COMBOS, ids=lambda combo: combo.id)
def test_kvcache_grid_tilelang_part_gpu(combo):
    run("gpu-tilelang-part", "tilelang", combo)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", AUTO_COMBOS, ids=lambda combo: combo.id)
def test_kvcache_grid_auto_gpu(combo):
    run("gpu-auto", "auto", combo)


@pytest.mark.parametrize("combo", CPU_COMBOS[:12] + CPU_FP8_COMBOS[:4], ids=lambda combo: combo.id)
def test_problem_of_a_combo_is_what_the_call_validates(combo):
    """``fa_grid.problem_of`` (tools/warmup_tests.py's view of a combo) matches the validated call."""
    call = {name: value for name, value in fa_grid.make_case(combo, "cpu").call.items()
            if name != "return_softmax_lse"}
    problem = flashdecode.plan_for(**call, backend="reference").problem
    expected = fa_grid.problem_of(combo)
    assert dataclasses.replace(problem, seqlen_new=min(problem.seqlen_new, 1), window_left=min(
        problem.window_left, 1), window_right=min(problem.window_right, 1)) == expected


def test_sample_covers_every_value_several_times():
    """The CPU sample's stratification: each axis value of its restricted grid in >= 3 combos; the fp8
    sample (its seed: the cheapest under the interpreter that does) holds both fp8 dtypes, softcap on
    and off, pages, appends, windows, splits, causal and batch indices."""
    for axis, values in fa_grid.AXES.items():
        for value in values:
            if axis == "dtype" and value != "float16" or axis == "seqlens" and value[1] > 1024:
                continue
            assert sum(getattr(combo, axis) == value for combo in CPU_COMBOS) >= 3, (axis, value)
    for axis in ("kv_dtype", "softcap", "paged_kv_block_size", "new_kv", "num_splits", "local", "causal",
                 "has_batch_idx"):
        assert len({getattr(combo, axis) for combo in CPU_FP8_COMBOS}) == 2, axis


def test_the_default_gpu_samples_cover_every_value_and_start_the_deeper_ones():
    """The GPU tier's default draws (GPU_SAMPLE combos, GPU_FP8_SAMPLE fp8 ones): every value of every
    axis in several combos, and the first combos of a deeper draw of the same seed."""
    general = fa_grid.sample(GPU_SAMPLE, seed=GRID_SEED)
    fp8 = fa_grid.sample(GPU_FP8_SAMPLE, seed=GRID_SEED + 3, restrict=fa_grid.FP8_AXES)
    for axes, combos, least in ((fa_grid.AXES, general, 10), ({**fa_grid.AXES, **fa_grid.FP8_AXES}, fp8, 4)):
        for axis, values in axes.items():
            for value in values:
                assert sum(getattr(combo, axis) == value for combo in combos) >= least, (axis, value)
    assert fa_grid.sample(2 * GPU_SAMPLE, seed=GRID_SEED)[:GPU_SAMPLE] == general


def test_report_is_written_after_every_combo_and_merges_across_workers(tmp_path):
    """A run cut by a time limit keeps its counts (written as they come, at most every few seconds);
    per-worker files sum to one report."""
    combos = CPU_COMBOS[:3]
    paths = [tmp_path / "grid.json.gw0", tmp_path / "grid.json.gw1"]
    for path, outcomes in zip(paths, (("pass", "fail"), ("pass",))):
        report = fa_grid.GridReport(str(path))
        report.record("gpu", "triton", combos[0], outcomes[0])
        assert json.loads(path.read_text()) == report.as_dict()  # the first outcome is on disk at once
        for combo, outcome in zip(combos[1:], outcomes[1:]):
            report.record("gpu", "triton", combo, outcome, "boom" if outcome == "fail" else "")
        report.flush()
        assert json.loads(path.read_text()) == report.as_dict()
    merged = fa_grid.merge_reports([json.loads(path.read_text()) for path in paths])
    entry = merged["gpu"]["triton"][combos[0].dtype]
    assert entry["total"] == {"pass": 2, "fail": 1}
    assert entry["failures"] == [{"id": combos[1].id, "message": "boom"}]
    feature = next(iter(combos[0].features()))
    expected = sum(feature in combo.features() for combo in (combos[0], combos[1], combos[0]))
    assert sum(entry["features"][feature].values()) == expected


def test_a_combo_is_read_back_from_its_id():
    """``Combo.from_id`` inverts ``Combo.id`` over a sample of the whole grid, of its fp8 part and of
    the extension axes (every axis value)."""
    for combo in (fa_grid.sample(300, seed=7) + fa_grid.sample(100, seed=7, restrict=fa_grid.FP8_AXES)
                  + fa_grid.extension_sample(5, seed=7)):
        assert fa_grid.Combo.from_id(combo.id).id == combo.id


def test_gpu_logs_give_each_combo_its_last_outcome():
    """Both pytest log layouts (-v alone and with pytest-xdist), the TileLang and auto tiers, pytest's
    suffix for coinciding ids; a later run's outcome replaces an earlier one's."""
    first, second, third, fourth = (combo.id for combo in CPU_COMBOS[:4])
    earlier = (f"tests/test_fa_kvcache.py::test_kvcache_grid_gpu[triton-{first}] FAILED [ 10%]\n"
               f"[gw3] [ 20%] SKIPPED tests/test_fa_kvcache.py::test_kvcache_grid_gpu[tilelang-{second}_1] \n"
               f"tests/test_fa_kvcache.py::test_kvcache_grid_tilelang_part_gpu[{third}] PASSED [ 30%]\n"
               f"[gw1] [ 40%] FAILED tests/test_fa_kvcache.py::test_kvcache_grid_auto_gpu[{fourth}] \n"
               f"FAILED tests/test_fa_kvcache.py::test_kvcache_grid_gpu[triton-{first}] - torch.OutOfMemoryError\n")
    later = f"[gw0] [ 50%] PASSED tests/test_fa_kvcache.py::test_kvcache_grid_gpu[triton-{first}] \n"
    outcomes = fa_grid.log_outcomes(later, fa_grid.log_outcomes(earlier))
    assert outcomes == {("triton", first): "pass", ("tilelang", second): "skip", ("tilelang", third): "pass",
                        ("auto", fourth): "fail"}
    report = fa_grid.coverage(outcomes)["gpu"]
    assert sum(sum(entry["total"].values()) for entry in report["tilelang"].values()) == 2
    assert sum(entry["total"].get("pass", 0) for entry in report["triton"].values()) == 1


def test_large_combos_run_one_at_a_time(monkeypatch):
    """Two workers' large combos do not overlap; a small combo does not wait for a large one."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    small = CPU_COMBOS[0]
    large = dataclasses.replace(small, seqlens=(1, LARGE_SEQLEN_K))
    spans = []

    def work(combo, hold):
        with one_large_combo_at_a_time(combo):
            begin = time.monotonic()
            time.sleep(hold)
            spans.append((combo.seqlens[1], begin, time.monotonic()))

    threads = [threading.Thread(target=work, args=(large, 0.3)) for _ in range(2)]
    threads.append(threading.Thread(target=work, args=(small, 0.05)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (_, _, first_end), (_, second_begin, _) = sorted(
        (span for span in spans if span[0] >= LARGE_SEQLEN_K), key=lambda span: span[1])
    assert second_begin >= first_end  # the second large combo waited for the first
    _, _, small_end = next(span for span in spans if span[0] < LARGE_SEQLEN_K)
    assert small_end < first_end  # the small one ran alongside


def test_full_part_is_every_distinct_combo_of_tilelangs_part(monkeypatch):
    """FLASHDECODE_FA_GRID_TILELANG=full: each id of TileLang's part once, every one within its axes."""
    monkeypatch.setenv("FLASHDECODE_FA_GRID_TILELANG", "full")
    combos = part_combos("FLASHDECODE_FA_GRID_TILELANG", "60", 0)
    assert len({combo.id for combo in combos}) == len(combos) == 6048
    assert all(getattr(combo, axis) in values for combo in combos for axis, values in TILELANG_AXES.items())
    monkeypatch.setenv("FLASHDECODE_FA_GRID_TILELANG", "many")
    with pytest.raises(ValueError, match="FLASHDECODE_FA_GRID_TILELANG"):
        part_combos("FLASHDECODE_FA_GRID_TILELANG", "60", 0)
