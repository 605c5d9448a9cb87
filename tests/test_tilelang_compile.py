"""The TileLang backend's configs, occupancy and capability answers, and every kernel it ships lowering
and compiling for Hopper (sm_90a) with nvcc.

Runs on CPU machines: TileLang compiles without a GPU when given an explicit target. Each split
kernel must keep the Hopper features the design relies on: TMA loads (``tma_load``) into a
warp-specialised pipeline whose producer loop runs on one warp (``patches.one_warp_producer``), and
wgmma for both products where the q tile has 64 rows (mma.sync for smaller tiles). Every serving feature
(paged, appended k/v, seqlen_q > 1 with causal, windows, softcap, sinks, fp8 caches, left pads, heads-first
caches) compiles too. Builds are shared
through one backend instance (its cache) and TileLang's disk cache. The kernels run in the GPU tests
(here: the fast launch against the public call, and each feature against the reference).
"""
import shutil
import types

import pytest
import torch

from conftest import build_except

tilelang = pytest.importorskip("tilelang")
from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels.tilelang import launch, occupancy, patches  # noqa: E402
from flashdecode.kernels.tilelang.backend import TileLangBackend, problem_limitation  # noqa: E402
from flashdecode.kernels.tilelang.config import CombineConfig, ShortCacheConfig, SplitConfig  # noqa: E402
from flashdecode.planner import SHORT_CACHE, SINGLE_PASS, SPLIT, plan  # noqa: E402
from flashdecode.problem import Problem  # noqa: E402

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
TARGET = {"kind": "cuda", "arch": "sm_90a"}
H200 = PROFILES["h200"]
BACKEND = TileLangBackend()  # one instance: tests share its compiled kernels
ONE_WARP_LOOP = f"if (((int)threadIdx.x) < {patches.PRODUCER_LOOP_MACRO}) for (int kb = "


def problem_of(dtype="bfloat16", head_dim=128, group=8, nheads_k=4, capacity=4096, **features):
    return Problem(2, capacity, group * nheads_k, nheads_k, head_dim, dtype, **features)


def compiled_source(kernel, problem, config=None):
    config = config or BACKEND.default_config(problem, H200, SHORT_CACHE if kernel == SHORT_CACHE else SPLIT)
    return BACKEND.compiled(kernel, problem, config, H200, TARGET).get_kernel_source()


# -- configs, occupancy, capabilities (no compile) ----------------------------------------------
@pytest.mark.parametrize("head_dim,block_n,split_tile", [(64, 64, (64, 64)), (128, 64, (64, 64)), (256, 32, (64, 16))])
def test_default_configs_are_the_shipped_choices(head_dim, block_n, split_tile):
    problem = problem_of(head_dim=head_dim)  # 8 query rows per KV head
    for kernel in (SPLIT, SINGLE_PASS):
        assert BACKEND.default_config(problem, H200, kernel) == SplitConfig(*split_tile, 2, 24, CombineConfig(16))
    assert BACKEND.default_config(problem, H200, SHORT_CACHE) == ShortCacheConfig(block_n, 16, False)
    assert BACKEND.default_config(problem_of(head_dim=head_dim, capacity=block_n), H200, SHORT_CACHE).one_tile
    assert BACKEND.default_config(problem_of(head_dim=head_dim, group=32), H200, SHORT_CACHE).block_m == 32
    with pytest.raises(ValueError, match="kernel must be one of"):
        BACKEND.default_config(problem, H200, "persistent")
    assert BACKEND.kernels(problem) == frozenset((SHORT_CACHE, SINGLE_PASS, SPLIT))


@pytest.mark.parametrize("head_dim,block_n,rows,expected", [
    (128, 64, 64, 2),   # the benchmark's kernels: registers and shared memory both allow 2
    (128, 64, 16, 3),   # 16-row tile: registers would allow 4, shared memory (72 KiB) 3
    (256, 32, 64, 1),   # 192 registers a thread: one program
])
def test_split_resident_programs(head_dim, block_n, rows, expected):
    config = SplitConfig(block_n, rows)
    assert BACKEND.resident_programs(problem_of(head_dim=head_dim), config, H200) == expected


@pytest.mark.parametrize("head_dim,block_n,rows,expected", [(128, 64, 64, 4), (256, 32, 64, 3), (256, 32, 16, 4)])
def test_short_cache_resident_programs(head_dim, block_n, rows, expected):
    assert occupancy.resident_programs(problem_of(head_dim=head_dim), ShortCacheConfig(block_n, rows), H200) == expected


def test_residency_takes_the_hardware_facts_from_the_profile():
    """A larger driver reserve or a lower register limit per thread lowers the residency."""
    import dataclasses

    problem, config = problem_of(), SplitConfig(64, 16)
    assert occupancy.resident_programs(problem, config, H200) == 3
    tighter = dataclasses.replace(H200, driver_reserved_shared_per_program=8 * 1024)
    assert occupancy.resident_programs(problem, config, tighter) == 2
    assert occupancy.resident_programs(problem, SplitConfig(64, 64),
                                       dataclasses.replace(H200, max_registers_per_thread=100)) == 1


@pytest.mark.parametrize("resident,expected", [(1, (24, 240)), (2, (24, 232)), (3, (24, 136))])
def test_register_split_moves_the_producers_share_to_the_consumer(resident, expected):
    """The consumer gets what the producer gives up within the program's launch share (65536
    registers over ``resident`` programs of 256 threads, a multiple of 8), at most 240."""
    assert occupancy.register_split(SplitConfig(64), resident, H200) == expected
    assert occupancy.register_split(SplitConfig(64, producer_registers=0), resident, H200) is None


def test_plans_name_the_kernels_the_backend_runs():
    """Up to 4 tiles of 64 and nothing split: short cache; up to 8: single pass; above: split."""
    for capacity, num_splits, kernel in [(1, 0, SHORT_CACHE), (64, 3, SINGLE_PASS), (256, 0, SHORT_CACHE),
                                         (256, 3, SPLIT), (257, 0, SINGLE_PASS), (600, 0, SPLIT)]:
        assert plan(problem_of(capacity=capacity), H200, BACKEND, num_splits).kernel == kernel


@pytest.mark.parametrize("problem,needs", [
    (problem_of(), None),
    (problem_of(dense=False), "contiguous"),
    (problem_of(head_dim=96), "head dim of 64, 128 or 256"),
    (problem_of(group=128, nheads_k=1), "at most 64 query rows"),
    (problem_of(page_size=256, seqlen_q=4, window_left=9, window_right=0, softcap=True, seqlen_new=4), None),
    (problem_of(page_size=8), "page_size of at least 16"),
    (problem_of(group=2, seqlen_q=17), "seqlen_q of at most 16"),
    (problem_of(seqlen_q=16), "at most 64 query rows"),
    (problem_of(rotary_dim=64, seqlen_new=1), "no rotary"),
    (problem_of(alibi=1), "no alibi"),
    (problem_of(leftpad=True), None),
    (problem_of(heads_first=True, leftpad=True, seqlen_q=4, window_left=7, window_right=0, softcap=True), None),
    (problem_of(heads_first=True, dense=False), "heads-first"),
    (problem_of(batch_idx=True), "no batch_idx"),
    (problem_of(sinks=True, cache_dtype="float8_e5m2", page_size=64), None),
    (problem_of(seqlen_q=4, ragged=True), "no ragged (the TileLang kernels do not implement it)"),
], ids=str)
def test_problem_limitation_names_what_is_missing(problem, needs):
    reason = problem_limitation(problem)
    assert reason == needs if needs is None else needs in reason


def test_the_short_cache_kernel_is_chosen_by_its_own_tiles():
    """Head dim 256: the short-cache tile (32 tokens) is half the wide split tile (64); up to
    short_cache_max_blocks of its own tiles take it, longer unsplit caches the single-pass kernel."""
    most = H200.tuning.short_cache_max_blocks * BACKEND.default_config(
        problem_of(head_dim=256, capacity=64), H200, SHORT_CACHE).block_n
    assert plan(problem_of(head_dim=256, capacity=most), H200, BACKEND).kernel == SHORT_CACHE
    assert plan(problem_of(head_dim=256, capacity=most + 1), H200, BACKEND).kernel == SINGLE_PASS
    assert plan(problem_of(head_dim=128, capacity=4 * 64), H200, BACKEND).kernel == SHORT_CACHE


def test_the_gpu_cases_cover_the_wide_head_tile():
    for name in ("wide-head-paged-16", "wide-head-all"):
        problem, _ = GPU_CASES[name]
        assert BACKEND.default_config(problem, H200, SPLIT).block_m == 16, name


def test_wide_heads_take_the_16_row_tile_where_it_fits():
    """Head dim 256: 16 q rows on 64 tokens; more rows, or tiles under 32 tokens, keep the 64-row tile."""
    assert BACKEND.default_config(problem_of(head_dim=256, group=16), H200, SPLIT).block_m == 16
    assert BACKEND.default_config(problem_of(head_dim=256, group=32), H200, SPLIT) == SplitConfig(32, 64)
    assert BACKEND.default_config(problem_of(head_dim=256, seqlen_q=4), H200, SPLIT) == SplitConfig(32, 64)
    assert BACKEND.default_config(problem_of(head_dim=256, page_size=16, seqlen_new=1), H200, SPLIT) == \
        SplitConfig(16, 64)
    assert BACKEND.default_config(problem_of(head_dim=256, page_size=32, seqlen_new=1), H200, SPLIT) == \
        SplitConfig(32, 16)


def test_paged_tiles_keep_their_size_whatever_the_page():
    """A tile lies within one page of 64 or more tokens, or gathers whole pages of 16 and 32."""
    for page_size in (16, 32, 64, 256):
        assert BACKEND.default_config(problem_of(page_size=page_size), H200, SPLIT).block_n == 64
        assert BACKEND.default_config(problem_of(page_size=page_size, capacity=64), H200, SHORT_CACHE).block_n == 64
    assert plan(problem_of(page_size=16, capacity=64), H200, BACKEND).kernel == SHORT_CACHE
    # appended tokens: the split kernel's tiles stay within a page (its gathered tail compiled for minutes)
    assert BACKEND.default_config(problem_of(page_size=16, seqlen_new=1), H200, SPLIT).block_n == 16
    assert BACKEND.default_config(problem_of(page_size=16, seqlen_new=1, capacity=64), H200, SHORT_CACHE).block_n == 64


def test_limitation_needs_a_hopper_gpu_on_cpu():
    assert "Hopper" in BACKEND.limitation(problem_of(), torch.device("cpu"))


def test_tilelang_counts_as_available_only_with_nvcc(monkeypatch):
    """TileLang compiles with the nvcc under its CUDA_HOME: without it the backend is unavailable."""
    import sys

    assert TileLangBackend().unavailable() is None or shutil.which("nvcc") is None
    monkeypatch.setattr(sys.modules["tilelang.env"], "CUDA_HOME", "/nonexistent")
    assert "nvcc" in TileLangBackend().unavailable()


def test_launcher_falls_back_to_the_public_call():
    """Where TileLang does not lay the kernel out as expected, the kernel object itself is called."""
    bare = types.SimpleNamespace()
    assert launch.fast_entry(bare) is None and launch.launcher(bare) is bare
    no_main = types.SimpleNamespace(adapter=types.SimpleNamespace(_get_executable=lambda: types.SimpleNamespace()))
    assert launch.fast_entry(no_main) is None and launch.launcher(no_main) is no_main


# -- compiles (nvcc) -----------------------------------------------------------------------------
SPECIALISATIONS = [  # (dtype, head_dim, group, nheads_k, can_split): every dtype, head dim and kernel form once
    ("bfloat16", 128, 8, 4, False), ("bfloat16", 128, 8, 4, True), ("float16", 256, 8, 4, True),
    ("float16", 64, 8, 4, False),
    ("bfloat16", 128, 1, 32, True),   # MHA
    ("bfloat16", 128, 32, 1, True),   # MQA, the largest group the 64-row q tile takes twice over
    ("bfloat16", 128, 4, 8, True),    # the other group of the benchmark matrix
]


@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,group,nheads_k,can_split",
                         build_except(SPECIALISATIONS, {("bfloat16", 128, 8, 4, True)}, several=True), ids=str)
def test_split_kernel_compiles_for_sm90a(dtype, head_dim, group, nheads_k, can_split):
    problem = problem_of(dtype, head_dim, group, nheads_k)
    config = BACKEND.default_config(problem, H200, SPLIT)
    registers = occupancy.register_split(config, occupancy.resident_programs(problem, config, H200), H200)
    source = compiled_source(SPLIT if can_split else SINGLE_PASS, problem)
    mma = "wgmma" if config.block_m >= 64 else "mma_sync"  # head dim 256: the 16-row wide-head tile
    assert "tma_load" in source and mma in source and ONE_WARP_LOOP in source
    assert f"warpgroup_reg_dealloc<{registers[0]}>" in source and f"warpgroup_reg_alloc<{registers[1]}>" in source
    if can_split:
        assert "decode_combine" in compiled_source("combine", problem)


@pytest.mark.build
@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,group", [("float16", 128, 4)], ids=str)
def test_small_q_tile_variant_compiles(dtype, head_dim, group):
    """A q tile under 64 rows at head dim 128 (a sweep's variant): mma.sync with column-split warps."""
    problem = problem_of(dtype, head_dim, group, 2)
    config = SplitConfig(BACKEND.default_config(problem, H200, SPLIT).block_n, max(16, group))
    source = compiled_source(SPLIT, problem, config)
    assert "tma_load" in source and "mma_sync" in source and "wgmma" not in source
    assert ONE_WARP_LOOP in source


@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,group,nheads_k", build_except(
    [("bfloat16", 128, 8, 4), ("float16", 256, 8, 4), ("bfloat16", 64, 32, 1)], {("bfloat16", 128, 8, 4)},
    several=True), ids=str)
def test_short_cache_kernel_compiles(dtype, head_dim, group, nheads_k):
    """Short unsplit caches take the short-cache kernel: no TMA pipeline, no producer; mma.sync
    below 64 rows (the shipped 16-row tile), wgmma at 64."""
    problem = problem_of(dtype, head_dim, group, nheads_k, capacity=64)
    for one_tile in (True, False):  # without and with the loop over tiles
        config = BACKEND.default_config(problem_of(dtype, head_dim, group, nheads_k, capacity=1 if one_tile else 4096),
                                        H200, SHORT_CACHE)
        assert config.one_tile == one_tile
        source = compiled_source(SHORT_CACHE, problem, config)
        assert ("wgmma" if config.block_m >= 64 else "mma_sync") in source and "tma_load" not in source
        assert f"__launch_bounds__(128, {occupancy.resident_programs(problem, config, H200)})" in source
        assert ("for (int t = 0" in source) != one_tile


@needs_nvcc
@pytest.mark.build
def test_fast_entry_finds_the_compiled_modules_function():
    """The launch path bypasses TileLang's adapter: it must still find the compiled entry function."""
    kernel = BACKEND.compiled(SPLIT, problem_of(), BACKEND.default_config(problem_of(), H200, SPLIT), H200, TARGET)
    entry = launch.fast_entry(kernel)
    assert type(entry).__name__ == "Function" and launch.launcher(kernel) is not kernel


@pytest.mark.gpu
def test_fast_entry_and_public_call_compute_the_same():
    """The entry function and TileLang's public call take the same arguments and give the same
    bytes (split kernel with partials, then the combine)."""
    from flashdecode.kernels.tilelang import build

    torch.manual_seed(0)
    problem = problem_of(capacity=1000)
    config = BACKEND.default_config(problem, H200, SPLIT)
    target = build.device_target()
    split = BACKEND.compiled(SPLIT, problem, config, H200, target)
    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 1000, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    lengths = torch.tensor([1000, 333], dtype=torch.int32, device="cuda")
    results = []
    for call in (launch.fast_entry(split), split):
        # poisoned alike: the split kernel leaves out/lse of split sequences to the combine
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 32), float("nan"), dtype=torch.float32, device="cuda")
        part_o = torch.full((8, 32, 128), float("nan"), device="cuda")
        part_lse = torch.full((8, 32), float("nan"), device="cuda")
        call(q, k, v, lengths, out, lse, part_o, part_lse, 8, 4, 1, 0.1)
        results.append((out, lse, part_o, part_lse))
    for fast, public in zip(*results):
        assert torch.equal(fast.nan_to_num(7.0), public.nan_to_num(7.0))


# -- the serving features (compile tests: one kernel set per feature, sharing the builds above) --------
HEAD_FIRST_OFFSET = "(((int64_t)((int)blockIdx.y)) * ((int64_t)capacity))"
FEATURES = {  # name: (problem, the text its split kernel's source must have)
    "paged": (problem_of(page_size=256), "BlockTable"),
    "paged-16": (problem_of(page_size=16), "BlockTable"),
    "paged-32-fp16-d64": (problem_of(dtype="float16", head_dim=64, page_size=32), "BlockTable"),
    "paged-16-d256": (problem_of(head_dim=256, page_size=16), "BlockTable"),
    "seqlen_q-causal": (problem_of(seqlen_q=4, window_right=0), "window_right"),
    "window": (problem_of(window_left=100), "window_left"),
    "softcap": (problem_of(softcap=True), "tanhf"),
    "append": (problem_of(seqlen_q=2, seqlen_new=2), "KNew"),
    "sinks": (problem_of(sinks=True), "Sinks"),
    "sinks-features-d256": (problem_of(head_dim=256, seqlen_q=2, page_size=64, seqlen_new=2, window_left=100,
                                       window_right=0, sinks=True), "Sinks"),
    "fp8": (problem_of(cache_dtype="float8_e4m3fn"), "fp8_e4_t"),
    "fp8-e5m2-fp16-d64-paged-16": (problem_of(dtype="float16", head_dim=64, page_size=16, cache_dtype="float8_e5m2"),
                                   "fp8_e5_t"),
    "fp8-d256-paged-16": (problem_of(head_dim=256, page_size=16, cache_dtype="float8_e4m3fn"), "fp8_e4_t"),
    "fp8-features": (problem_of(seqlen_q=2, page_size=64, seqlen_new=2, window_left=100, window_right=0, softcap=True,
                                sinks=True, cache_dtype="float8_e5m2"), "fp8_e5_t"),
    # head h's keys start h * capacity * D elements into the sequence's (a heads-first cache)
    "heads_first": (problem_of(heads_first=True), HEAD_FIRST_OFFSET),
    "leftpad": (problem_of(leftpad=True), "LeftPad"),
}


@needs_nvcc
@pytest.mark.parametrize("name", build_except(FEATURES, {"append"}))
def test_feature_kernels_compile_for_sm90a(name):
    """Each feature's split kernel keeps the TMA pipeline, its tensor-core form and the one-warp
    producer loop; its combine and its short-cache kernel compile too."""
    problem, marker = FEATURES[name]
    config = BACKEND.default_config(problem, H200, SPLIT)
    split = BACKEND.compiled(SPLIT, problem, config, H200, TARGET)
    source = split.get_kernel_source()
    mma = "wgmma" if config.block_m >= 64 else "mma_sync"  # head dim 256: the 16-row wide-head tile
    assert "tma_load" in source and mma in source and ONE_WARP_LOOP in source and marker in source
    assert "decode_combine" in compiled_source("combine", problem)
    short = BACKEND.default_config(problem, H200, SHORT_CACHE)
    assert marker in compiled_source(SHORT_CACHE, problem, short)
    if problem.paged:  # K and V: one TMA load per tile, or per page and 128-byte column chunk of a gathered one
        pages = config.block_n // problem.page_size
        chunks = max(1, problem.headdim * problem.cache_element_bytes // 128)
        assert source.count("tl::tma_load(") == (2 * pages * chunks if pages > 1 else 2)
    if problem.cache_dtype is not None:  # the pipeline moves 1-byte tiles, converted before the products
        fp8 = marker
        assert "tl::tma_load(K_desc" in source and f"(({fp8}*)k_s)" in source and f"(({fp8}*)v_s)" in source
        assert f"arrive_and_expect_tx({config.block_n * problem.headdim})" in source
        assert "k_wide" in source and "v_wide" in source
        if problem.seqlen_new:  # appended tokens: divided by the descale (IEEE), saturated, stored as fp8
            assert "__fdiv_rn" in source and ("0x1.cp+8f" if fp8 == "fp8_e4_t" else "0x1.cp+15f") in source
    # the TMA descriptor's strides (bytes): a token D elements on, a head capacity * D (heads-first) or D
    head_stride = f"(((int64_t)capacity) * (int64_t){problem.headdim * problem.cache_element_bytes})"
    assert (head_stride in split.get_host_source()) == problem.heads_first
    if problem.leftpad:  # the blocks start at the left pad's block, and the keys before it are masked
        for kernel_source in (source, compiled_source(SHORT_CACHE, problem, short)):
            assert "int leftpad = " in kernel_source and "min(max(leftpad, 0), " in kernel_source
            assert "(start <= " in kernel_source and "(leftpad < 0)) || (raw_len < leftpad)" in kernel_source
        sequence = "((int64_t)((int)blockIdx.x))"  # the combine's: a bad left pad makes its rows NaN too
        assert f"(seqlens[{sequence}] < LeftPad[{sequence}])" in compiled_source("combine", problem)


@needs_nvcc
def test_short_cache_kernel_folds_the_sinks_in():
    """With sinks the kernel reads each row's sink logit (its query head's) and adds it to the row's
    denominator in base 2 before writing out and lse (the split kernel and the combine: ``slow``)."""
    source = compiled_source(SHORT_CACHE, problem_of(sinks=True))
    assert "const float* __restrict__ Sinks" in source and "0x1.71547652b82fep+0f" in source  # log2(e)
    assert "exp2f((sink - shift))" in source


@needs_nvcc
def test_short_cache_kernel_reads_fp8_caches_as_bytes():
    """An e4m3 cache is read 8 one-byte elements at a time and converted to q's dtype in registers
    (``__tl_cvt_e4m3x2_to_bfloat162``) before the tile reaches shared memory, and k's descale is read
    (the split kernel, appended tokens: ``slow``)."""
    source = compiled_source(SHORT_CACHE, problem_of(cache_dtype="float8_e4m3fn"))
    assert "const fp8_e4_t* __restrict__ K" in source and "= *(fp8_e4_8_t*)(K + " in source
    assert "__tl_cvt_e4m3x2_to_bfloat162" in source and "KDescale[" in source and "VDescale[" in source


def test_feature_parameters_follow_the_plain_ones_in_launch_order():
    """The backend passes block_table, k, v, softcap, the window sizes, the descales, sinks and
    cache_leftpad after the plain arguments, in this order (and seqlen_new, window_left, sinks and
    cache_leftpad to the combine)."""
    from flashdecode.kernels.tilelang import kernels
    from flashdecode.kernels.tilelang.config import KernelShape

    problem = problem_of(page_size=64, seqlen_q=2, window_left=9, window_right=0, softcap=True, seqlen_new=2,
                         sinks=True, cache_dtype="float8_e4m3fn", leftpad=True)
    shape, config = KernelShape.of(problem), BACKEND.default_config(problem, H200, SPLIT)
    features = ["BlockTable", "KNew", "VNew", "softcap", "window_left", "window_right", "KDescale", "VDescale",
                "k_descale_stride_b", "k_descale_stride_h", "v_descale_stride_b", "v_descale_stride_h", "Sinks",
                "LeftPad"]
    names = [param.name.removesuffix("_handle") for param in kernels.split_kernel(shape, config, True, 2).params]
    assert names[12:] == features
    short = BACKEND.default_config(problem, H200, SHORT_CACHE)
    names = [param.name.removesuffix("_handle") for param in kernels.short_cache_kernel(shape, short, 4).params]
    assert names[7:] == features
    names = [param.name.removesuffix("_handle") for param in kernels.combine_kernel(shape, config.combine, 64).params]
    assert names[9:] == ["new_tokens", "window_left", "Sinks", "LeftPad"]


# -- the serving features against the reference (GPU; the lead's machine) ----------------------------
#: name: (problem, FlashAttention keyword arguments beyond the tensors). Lengths are full, 0 and
#: off a tile boundary; num_splits 0 and 3 run the balanced and the forced split.
GPU_CASES = {
    "paged-256": (Problem(3, 1024, 32, 4, 128, "bfloat16", page_size=256), {}),
    "paged-16": (Problem(3, 512, 32, 4, 128, "float16", page_size=16), {}),
    "causal": (Problem(3, 1000, 32, 4, 128, "bfloat16", seqlen_q=4, window_right=0), {"causal": True}),
    "window": (Problem(3, 1000, 16, 2, 128, "bfloat16", seqlen_q=2, window_left=100, window_right=3),
               {"window_size": (100, 3)}),
    "softcap": (Problem(3, 1000, 32, 4, 128, "bfloat16", softcap=True), {"softcap": 30.0}),
    "append": (Problem(3, 1000, 32, 4, 128, "bfloat16", seqlen_q=2, seqlen_new=2), {}),
    "short-append-paged": (Problem(3, 128, 32, 4, 128, "bfloat16", page_size=64, seqlen_new=3), {}),
    "short-append-paged-16": (Problem(3, 128, 32, 4, 128, "bfloat16", page_size=16, seqlen_new=3), {}),
    "causal-paged-16-d256": (Problem(3, 1000 // 16 * 16, 32, 4, 256, "bfloat16", seqlen_q=4, page_size=16,
                                     window_right=0), {"causal": True}),
    "all": (Problem(3, 1024, 32, 4, 128, "bfloat16", seqlen_q=4, page_size=64, seqlen_new=4, window_left=200,
                    window_right=0, softcap=True), {"causal": True, "window_size": (200, 0), "softcap": 30.0}),
    # head dim 256 with at most 16 query rows: the wide-head tile (16 rows on 64 tokens)
    "wide-head-paged-16": (Problem(3, 512, 16, 4, 256, "float16", page_size=16), {}),
    "wide-head-all": (Problem(3, 1024, 16, 4, 256, "bfloat16", seqlen_q=2, page_size=64, seqlen_new=2,
                              window_left=200, window_right=0, softcap=True),
                      {"causal": True, "window_size": (200, 0), "softcap": 30.0}),
    # sinks (``gpu_inputs`` draws them): the short-cache kernel, the split kernel and its combine, with
    # rows that see no key (length 0, windows)
    "sinks": (Problem(3, 1000, 32, 4, 128, "bfloat16", sinks=True), {}),
    "sinks-short-paged-16": (Problem(3, 128, 32, 4, 128, "bfloat16", page_size=16, seqlen_new=3, sinks=True), {}),
    "sinks-all": (Problem(3, 1024, 32, 4, 128, "bfloat16", seqlen_q=4, page_size=64, seqlen_new=4, window_left=200,
                          window_right=0, softcap=True, sinks=True),
                  {"causal": True, "window_size": (200, 0), "softcap": 30.0}),
    "sinks-wide-head-window": (Problem(3, 1024, 16, 4, 256, "float16", seqlen_q=2, window_left=5, window_right=0,
                                       sinks=True), {"causal": True, "window_size": (5, 0)}),
    # transformers' caches (``gpu_inputs`` lays them out heads-first) and left pads (a block's middle, none,
    # the length: a sequence without keys)
    "heads_first": (Problem(3, 1000, 32, 4, 128, "bfloat16", heads_first=True), {}),
    "leftpad": (Problem(3, 1000, 32, 4, 128, "bfloat16", leftpad=True), {}),
    "heads_first-leftpad-short-append": (Problem(3, 128, 32, 4, 128, "bfloat16", seqlen_new=3, heads_first=True,
                                                 leftpad=True), {}),
    "heads_first-leftpad-all": (Problem(3, 1000, 16, 4, 128, "bfloat16", seqlen_q=4, window_left=200, window_right=0,
                                        softcap=True, heads_first=True, leftpad=True),
                                {"causal": True, "window_size": (200, 0), "softcap": 30.0}),
    "heads_first-leftpad-wide-head": (Problem(3, 1000, 8, 4, 256, "bfloat16", seqlen_q=6, window_left=7,
                                              window_right=0, softcap=True, heads_first=True, leftpad=True),
                                      {"causal": True, "window_size": (7, 0), "softcap": 30.0}),
}


def gpu_inputs(problem, seed=0):
    """Random q, caches (pages in a shuffled block table when paged, (batch, nheads_k, seqlen, headdim)
    transposed when heads-first), new k/v, sinks, lengths [full, 0, off a tile boundary] and left pads
    [70, 0, the length] for ``problem``."""
    generator = torch.Generator("cuda").manual_seed(seed)
    dtype = getattr(torch, problem.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda").to(dtype)

    batch, heads_k, head_dim = problem.batch, problem.nheads_k, problem.headdim
    tensors = {"q": randn(batch, problem.seqlen_q, problem.nheads, head_dim)}
    if problem.paged:
        blocks = problem.seqlen_cache // problem.page_size
        tensors["block_table"] = torch.randperm(batch * blocks, device="cuda", generator=generator).to(
            torch.int32).view(batch, blocks)
        cache_shape = (batch * blocks, problem.page_size, heads_k, head_dim)
    else:
        cache_shape = (batch, problem.seqlen_cache, heads_k, head_dim)
    tensors["k_cache"], tensors["v_cache"] = randn(*cache_shape), randn(*cache_shape)
    if problem.heads_first:
        stored = (batch, heads_k, problem.seqlen_cache, head_dim)
        tensors["k_cache"], tensors["v_cache"] = (randn(*stored).transpose(1, 2) for _ in range(2))
    if problem.seqlen_new:
        tensors["k"], tensors["v"] = (randn(batch, problem.seqlen_new, heads_k, head_dim) for _ in range(2))
    if problem.sinks:
        tensors["sinks"] = torch.randn(problem.nheads, generator=generator, device="cuda") * 3
    longest = problem.seqlen_cache - problem.seqlen_new
    tensors["cache_seqlens"] = torch.tensor([longest, 0, min(longest, 333)], dtype=torch.int32, device="cuda")
    if problem.leftpad:
        tensors["cache_leftpad"] = torch.tensor([min(longest, 70), 0, min(longest, 333)], dtype=torch.int32,
                                                device="cuda")
    return tensors


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("name", GPU_CASES)
def test_features_match_the_reference(name, num_splits):
    from flashdecode import flash_attn_with_kvcache, plan_for
    from flashdecode.reference import reference_attention, relative_error

    problem, options = GPU_CASES[name]
    tensors = gpu_inputs(problem)
    validated = plan_for(**tensors, **options, num_splits=num_splits, backend="reference").problem
    assert (validated.dense, validated.heads_first, validated.leftpad) == (True, problem.heads_first, problem.leftpad)
    expected_caches = {cache: tensors[cache].clone() for cache in ("k_cache", "v_cache")}
    expected, expected_lse = reference_attention(**{**tensors, **expected_caches}, **options)
    out, lse = flash_attn_with_kvcache(**tensors, **options, num_splits=num_splits, return_softmax_lse=True,
                                       backend="tilelang")
    assert not out.isnan().any() and not lse.isnan().any()
    assert relative_error(out, expected) < 1e-2
    seen = torch.isfinite(expected_lse)
    assert torch.equal(seen, torch.isfinite(lse)) and (out.transpose(1, 2)[~seen] == 0).all()
    torch.testing.assert_close(lse[seen], expected_lse[seen], atol=1e-2, rtol=0)
    for cache in ("k_cache", "v_cache"):  # the appended tokens landed where the reference put them
        assert torch.equal(tensors[cache], expected_caches[cache])


@pytest.mark.gpu
def test_a_bad_block_id_gives_nan_rows_of_its_sequence_only():
    from flashdecode import flash_attn_with_kvcache
    from flashdecode.reference import reference_attention, relative_error

    problem, _ = GPU_CASES["paged-256"]
    tensors = gpu_inputs(problem)
    tensors["cache_seqlens"][1] = 300
    expected, _ = reference_attention(**tensors)
    tensors["block_table"][1, 1] = -7  # a page sequence 1 reads
    for num_splits in (0, 3):
        out = flash_attn_with_kvcache(**tensors, num_splits=num_splits, backend="tilelang")
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
        assert relative_error(out[[0, 2]], expected[[0, 2]]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [-1, 334])
def test_a_bad_left_pad_gives_nan_rows_of_its_sequence_only(bad):
    """A left pad outside [0, cache_seqlens[b]] (sequence 2 is 333 long) makes NaN rows, unsplit and
    split (the combine flags it too)."""
    from flashdecode import flash_attn_with_kvcache
    from flashdecode.reference import reference_attention, relative_error

    tensors = gpu_inputs(GPU_CASES["leftpad"][0])
    expected, _ = reference_attention(**tensors)
    tensors["cache_leftpad"][2] = bad
    for num_splits in (0, 3):
        out = flash_attn_with_kvcache(**tensors, num_splits=num_splits, backend="tilelang")
        assert out[2].isnan().all() and not out[:2].isnan().any()
        assert relative_error(out[:2], expected[:2]) < 1e-2


def test_tilelang_source_names_workspaces_by_their_address(monkeypatch):
    """Two builds of head dim 256's split kernel named its two workspaces at one address in either
    order: tools/tilelang_source.py writes both alike, and leaves other names (workspace_rows) be."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "tools" / "tilelang_source.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its neighbour triton_ptx, as when run as a script
    spec = importlib.util.spec_from_file_location("tilelang_source", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    declared = ("  void* workspace = ((void*)((char*)buf_dyn_shmem + 512));\n"
                "  void* workspace_1 = ((void*)((char*)buf_dyn_shmem + 512));\n")
    first = declared + "  f(((float*)workspace)[0], workspace_rows);\n  g(((float*)workspace_1)[0]);\n"
    second = declared + "  f(((float*)workspace_1)[0], workspace_rows);\n  g(((float*)workspace)[0]);\n"
    assert first != second and tool.canonical(first) == tool.canonical(second)
    assert "f(((float*)[((void*)((char*)buf_dyn_shmem + 512))])[0], workspace_rows);" in tool.canonical(first)


#: tools/tilelang_source.py on one plan (case 1's one-tile short-cache kernel), in a process of its
#: own (it turns TileLang's disk cache off): the file it writes, and the comparison of two folders.
TILELANG_SOURCE_SCRIPT = """
import json, pathlib, shutil, sys, tempfile
sys.path.insert(0, "tools")
import tilelang_source
from triton_ptx import compare  # the comparison tilelang_source.py --compare prints
from flashdecode.problem import Problem
tilelang_source.PROBLEMS = {"case1": Problem(1, 1, 32, 4, 128, "bfloat16")}
folder = pathlib.Path(tempfile.mkdtemp()) / "mine"
names = tilelang_source.write(folder)
other = folder.with_name("other")
shutil.copytree(folder, other)
same = compare(folder, other, "*.cu")
(other / names[0]).write_text((folder / names[0]).read_text() + "// changed\\n")
print(json.dumps(dict(names=names, kernel="__global__" in (folder / names[0]).read_text(), same=same,
                      changed=compare(folder, other, "*.cu"))))
"""


@pytest.mark.slow
@needs_nvcc
def test_tilelang_source_writes_the_generated_kernels_of_a_plan():
    import json
    import pathlib
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TILELANG_SOURCE_SCRIPT], cwd=pathlib.Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["names"] == ["case1-short_cache.cu"] and found["kernel"]
    assert found["same"] == {"case1-short_cache.cu": "same"}
    assert found["changed"] == {"case1-short_cache.cu": "differs"}
