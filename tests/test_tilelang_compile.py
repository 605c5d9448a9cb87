"""Every supported TileLang specialisation lowers and compiles for Hopper (sm_90a) with nvcc.

Runs on CPU machines: TileLang compiles without a GPU when given an explicit target. Each split
kernel must keep the Hopper features the design relies on: TMA loads (``tma_load``) into a
warp-specialised pipeline whose producer loop runs on one warp (``one_warp_producer``), and wgmma
for both products where the q tile has 64 rows (mma.sync for smaller tiles). The kernels are built
with the shipped knobs; they run in the GPU tests.
"""
import itertools
import shutil

import pytest

tilelang = pytest.importorskip("tilelang")
from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels.tilelang import decode  # noqa: E402
from flashdecode.planner import Problem, choose_block_n  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
TARGET = {"kind": "cuda", "arch": "sm_90a"}
H200 = PROFILES["h200"]
ONE_WARP_LOOP = f"if (((int)threadIdx.x) < {decode._PRODUCER_LOOP_MACRO}) for (int kb = "

SPECIALISATIONS = [  # (dtype, head_dim, group, nheads_k, can_split)
    *itertools.product(["float16", "bfloat16"], [64, 128, 256], [8], [4], [False, True]),
    ("bfloat16", 128, 1, 32, True),   # MHA
    ("bfloat16", 128, 32, 1, True),   # MQA, the largest group the 64-row q tile takes twice over
    ("bfloat16", 128, 4, 8, True),    # the other group of the benchmark matrix
]


def _resident(head_dim, block_n, rows):
    return decode.resident_programs(head_dim, block_n, rows, decode.NUM_STAGES, H200.registers_per_multiprocessor,
                                    H200.shared_memory_per_multiprocessor)


@pytest.mark.parametrize("head_dim,block_n,rows,expected", [
    (128, 64, 64, 2),   # the benchmark's kernels: registers and shared memory both allow 2
    (128, 64, 16, 3),   # 16-row tile: registers would allow 4, shared memory (72 KiB) 3
    (256, 32, 64, 1),   # 192 registers a thread: one program
])
def test_resident_programs(head_dim, block_n, rows, expected):
    assert _resident(head_dim, block_n, rows) == expected


@pytest.mark.parametrize("dtype,head_dim,group,nheads_k,can_split", SPECIALISATIONS,
                         ids=lambda v: str(v))
def test_compiles_for_sm90a(dtype, head_dim, group, nheads_k, can_split):
    block_n = choose_block_n(Problem(1, 4096, group * nheads_k, nheads_k, head_dim, dtype), H200)
    rows = decode.q_tile_rows(group, decode.MIN_Q_ROWS)
    blocks_per_sm = _resident(head_dim, block_n, rows)
    registers = decode.split_kernel_registers(blocks_per_sm, H200.registers_per_multiprocessor)
    split = decode.build_split_kernel(dtype, head_dim, group, nheads_k, block_n, decode.NUM_STAGES, can_split,
                                      blocks_per_sm, rows, registers, target=TARGET)
    source = split.get_kernel_source()
    assert "tma_load" in source and ("wgmma" if rows >= 64 else "mma_sync") in source
    assert ONE_WARP_LOOP in source
    assert f"warpgroup_reg_dealloc<{registers[0]}>" in source and f"warpgroup_reg_alloc<{registers[1]}>" in source
    if can_split:
        combine = decode.build_combine_kernel(dtype, head_dim, group, nheads_k, block_n, can_split,
                                              target=TARGET)
        assert "decode_combine" in combine.get_kernel_source()


@pytest.mark.parametrize("dtype,head_dim,group", [("bfloat16", 128, 8), ("float16", 256, 4), ("bfloat16", 64, 32)],
                         ids=str)
def test_small_q_tile_variant_compiles(dtype, head_dim, group):
    """The sweep's ``MIN_Q_ROWS = 16`` variant (perf log 10): mma.sync with column-split warps."""
    block_n = choose_block_n(Problem(1, 4096, group * 2, 2, head_dim, dtype), H200)
    rows = decode.q_tile_rows(group, 16)
    assert rows == max(16, group)
    blocks_per_sm = _resident(head_dim, block_n, rows)
    split = decode.build_split_kernel(dtype, head_dim, group, 2, block_n, decode.NUM_STAGES, True, blocks_per_sm,
                                      rows, decode.split_kernel_registers(blocks_per_sm, H200.registers_per_multiprocessor),
                                      target=TARGET)
    source = split.get_kernel_source()
    assert "tma_load" in source and "mma_sync" in source and "wgmma" not in source
    assert ONE_WARP_LOOP in source


@pytest.mark.parametrize("dtype,head_dim,group,nheads_k",
                         [(d, h, 8, 4) for d in ("float16", "bfloat16") for h in (64, 128, 256)]
                         + [("bfloat16", 128, 32, 1), ("bfloat16", 128, 4, 8)], ids=str)
def test_short_cache_kernel_compiles(dtype, head_dim, group, nheads_k):
    """Short unsplit caches take the short-cache kernel: no TMA pipeline, no producer; mma.sync
    below 64 rows (the shipped 16-row tile), wgmma at 64."""
    block_n = choose_block_n(Problem(1, 64, group * nheads_k, nheads_k, head_dim, dtype), H200)
    rows = decode.q_tile_rows(group, decode.SHORT_CACHE_MIN_Q_ROWS)
    blocks_per_sm = decode.short_cache_resident_programs(head_dim, block_n, rows, H200.registers_per_multiprocessor,
                                                         H200.shared_memory_per_multiprocessor)
    for one_tile in (True, False):  # without and with the loop over tiles
        source = decode.build_short_cache_kernel(dtype, head_dim, group, nheads_k, block_n, blocks_per_sm, rows,
                                                 one_tile, target=TARGET).get_kernel_source()
        assert ("wgmma" if rows >= 64 else "mma_sync") in source and "tma_load" not in source
        assert f"__launch_bounds__(128, {blocks_per_sm})" in source
        assert ("for (int t = 0" in source) != one_tile


@pytest.mark.parametrize("head_dim,block_n,rows,expected", [(128, 64, 64, 4), (256, 32, 64, 3), (256, 32, 16, 4)])
def test_short_cache_resident_programs(head_dim, block_n, rows, expected):
    assert decode.short_cache_resident_programs(head_dim, block_n, rows, H200.registers_per_multiprocessor,
                                                H200.shared_memory_per_multiprocessor) == expected


@pytest.mark.parametrize("blocks_per_sm,expected", [(1, (24, 240)), (2, (24, 232)), (3, (24, 136))])
def test_split_kernel_registers_move_the_producers_share_to_the_consumer(blocks_per_sm, expected):
    """The consumer gets what the producer gives up within the program's launch share (65536
    registers over blocks_per_sm programs of 256 threads, a multiple of 8), at most 240."""
    assert decode.split_kernel_registers(blocks_per_sm, H200.registers_per_multiprocessor, 24) == expected
    assert decode.split_kernel_registers(blocks_per_sm, H200.registers_per_multiprocessor, 0) is None


def test_kernels_for_returns_launchers_of_the_compiled_module():
    """The launch path bypasses TileLang's adapter: it must still find the compiled entry function."""
    split, combine = decode.kernels_for("bfloat16", 128, 8, 4, 64, True, H200.registers_per_multiprocessor,
                                        H200.shared_memory_per_multiprocessor, decode.NUM_STAGES, decode.MIN_Q_ROWS,
                                        decode.PRODUCER_REGISTERS, target=decode._freeze(TARGET))
    assert type(split).__name__ == "Function" and type(combine).__name__ == "Function"


def test_launchers_for_picks_the_short_cache_kernel_for_short_unsplit_caches():
    """run(), the prebuild script and the hang reproducer share this choice: up to
    SHORT_CACHE_MAX_BLOCKS (3) tiles of 64 and nothing split."""
    from flashdecode.planner import plan

    target = decode._freeze(TARGET)
    for capacity, num_splits, short in [(1, 0, True), (64, 3, True), (192, 0, True), (192, 3, False),
                                        (193, 0, False), (600, 0, False)]:
        problem = Problem(2, capacity, 32, 4, 128, "bfloat16")
        p = plan(problem, H200, num_splits)
        assert decode.takes_short_cache(problem, p) == short
        first, combine = decode.launchers_for(problem, p, H200, target)
        assert type(first).__name__ == "Function"
        assert combine is None if short else p.can_split == (combine is not None)


PRODUCER_SOURCE = """\
extern "C" __global__ void decode_split_kernel() {
  if (((int)threadIdx.x) < 128) {
    tl::fence_proxy_async();
    for (int kb = blk_lo; kb < blk_hi; ++kb) {
      mbarrier[4].wait(1);
      if (tl::tl_shuffle_elect<128>()) { tl::tma_load(K_desc, mbarrier[0], k_s, 0, kb); }
    }
  } else {
    for (int kb_1 = blk_lo_1; kb_1 < blk_hi; ++kb_1) { mbarrier[0].wait(0); tl::wgmma_ss(desc_a, desc_b, s_f); }
  }
}
"""


def test_one_warp_producer_guards_the_producer_loop_only():
    rewritten = decode.one_warp_producer(PRODUCER_SOURCE)
    assert rewritten.replace(ONE_WARP_LOOP, "for (int kb = ") == PRODUCER_SOURCE
    assert rewritten.count(ONE_WARP_LOOP) == 1 and "for (int kb_1 = " in rewritten


@pytest.mark.parametrize("source", [
    PRODUCER_SOURCE.replace("tl::tma_load", "tl::cp_async"),                 # no TMA in the loop
    PRODUCER_SOURCE.replace("for (int kb_1", "for (int kb"),                  # two loops of kb
    PRODUCER_SOURCE.replace("if (((int)threadIdx.x) < 128) {", "if (p) {"),   # no producer branch
    PRODUCER_SOURCE.replace("tl::fence_proxy_async();", "} else {"),          # the loop is a consumer's
    PRODUCER_SOURCE.replace("tl::fence_proxy_async();", "} if (128 <= ((int)threadIdx.x)) {"),  # branch closed
    PRODUCER_SOURCE.replace("tl::wgmma_ss", "tl::copy"),                      # no products in the else
], ids=["no-tma", "two-loops", "no-branch", "consumer-loop", "closed-branch", "no-consumer"])
def test_one_warp_producer_refuses_an_unexpected_source(source):
    """Another TileLang may emit another loop: the rewrite must fail loudly, not guard the wrong code."""
    with pytest.raises(ValueError, match="one producer TMA loop"):
        decode.one_warp_producer(source)


def test_postproc_hook_applies_to_this_threads_kernel_only_and_is_restored():
    """The rewrite runs after a hook the user set, only on the named kernel compiled by the thread
    inside the block (another thread compiling meanwhile gets the user's hook alone), and the
    user's hook is back afterwards, also after an exception."""
    import threading

    import tvm_ffi

    name = "tilelang_callback_cuda_postproc"
    hook = lambda: tvm_ffi.get_global_func(name)  # noqa: E731
    tvm_ffi.register_global_func(name, f=lambda code, target: code + "// user", override=True)
    try:
        with decode._cuda_postproc(lambda code: code + "// ours", "kernel_a"):
            assert hook()("kernel_a", None) == "kernel_a// user// ours"
            assert hook()("kernel_b", None) == "kernel_b// user"
            other = []
            worker = threading.Thread(target=lambda: other.append(hook()("kernel_a", None)))
            worker.start()
            worker.join()
            assert other == ["kernel_a// user"]
            with decode._cuda_postproc(lambda code: code + "// inner", "kernel_a"):  # nested: no deadlock
                assert hook()("kernel_a", None) == "kernel_a// user// inner"
        assert hook()("kernel_a", None) == "kernel_a// user"
        with pytest.raises(RuntimeError):
            with decode._cuda_postproc(lambda code: code + "// ours", "kernel_a"):
                raise RuntimeError("compile failed")
        assert hook()("kernel_a", None) == "kernel_a// user"
    finally:
        tvm_ffi.remove_global_func(name)
    with decode._cuda_postproc(lambda code: code, "kernel_a"):
        pass
    assert tvm_ffi.get_global_func(name, allow_missing=True) is None


def test_tilelang_counts_as_available_only_with_nvcc(monkeypatch):
    """auto takes TileLang only where its kernels can be built: TileLang compiles with the nvcc under
    its CUDA_HOME."""
    import sys

    from flashdecode import api

    tilelang_env = sys.modules["tilelang.env"]  # the module (the attribute tilelang.env is an object)

    try:
        api.tilelang_available.cache_clear()
        assert api.tilelang_available()  # this machine builds the kernels above
        api.tilelang_available.cache_clear()
        monkeypatch.setattr(tilelang_env, "CUDA_HOME", "/nonexistent")
        assert not api.tilelang_available()
    finally:
        api.tilelang_available.cache_clear()
