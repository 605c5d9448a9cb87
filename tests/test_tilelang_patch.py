"""The rewrite of TileLang's generated split kernel (``patches.one_warp_producer``) and its hook.

The rewrite depends on the layout of the CUDA TileLang emits: ``test_tilelang_still_emits_the_expected
producer_loop`` lowers the shipped split kernel with the installed TileLang (no nvcc needed) and fails
when that layout changes, before a GPU ever runs the kernel.
"""
import threading

import pytest

tilelang = pytest.importorskip("tilelang")
import tvm_ffi  # noqa: E402

from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels.tilelang import kernels, occupancy, patches  # noqa: E402
from flashdecode.kernels.tilelang.backend import TileLangBackend  # noqa: E402
from flashdecode.kernels.tilelang.config import KernelShape  # noqa: E402
from flashdecode.planner import SPLIT  # noqa: E402
from flashdecode.problem import Problem  # noqa: E402

ONE_WARP_LOOP = f"if (((int)threadIdx.x) < {patches.PRODUCER_LOOP_MACRO}) for (int kb = "

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
    rewritten = patches.one_warp_producer(PRODUCER_SOURCE)
    assert rewritten.replace(ONE_WARP_LOOP, "for (int kb = ") == PRODUCER_SOURCE
    assert rewritten.count(ONE_WARP_LOOP) == 1 and "for (int kb_1 = " in rewritten
    assert patches.is_rewritten(rewritten) and not patches.is_rewritten(PRODUCER_SOURCE)


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
        patches.one_warp_producer(source)


@pytest.mark.slow  # the fast tier's TileLang compile tests apply the rewrite, which fails without this loop
@pytest.mark.parametrize("dtype,head_dim,group,can_split", [("bfloat16", 128, 8, True), ("float16", 256, 4, False)],
                         ids=str)
def test_tilelang_still_emits_the_expected_producer_loop(dtype, head_dim, group, can_split):
    """TileLang's own split kernel source (lowered without the hook) has the one producer TMA loop the
    rewrite guards; a TileLang that emits it otherwise fails here."""
    h200 = PROFILES["h200"]
    problem = Problem(2, 4096, 4 * group, 4, head_dim, dtype)
    config = TileLangBackend().default_config(problem, h200, SPLIT)
    resident = occupancy.resident_programs(problem, config, h200)
    func = kernels.split_kernel(KernelShape.of(problem), config, can_split, resident,
                                occupancy.register_split(config, resident, h200))
    target = tilelang.tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        source = tilelang.lower(func, target=target).kernel_source
    assert not patches.is_rewritten(source) and kernels.SPLIT_KERNEL_NAME in source
    rewritten = patches.one_warp_producer(source)
    assert patches.is_rewritten(rewritten)
    loop = rewritten[rewritten.index(ONE_WARP_LOOP):]
    assert "tma_load" in loop[:loop.index("} else {")]


def test_the_rewrite_is_gated_on_the_tilelang_it_was_written_for():
    assert patches.unsupported_version() is None, "TileLang changed: re-check the split kernel's producer loop"
    assert patches.unsupported_version("0.1.15+cu130") is None
    assert "TileLang 0.1.15" in patches.unsupported_version("0.1.16")


def test_postproc_hook_applies_to_this_threads_kernel_only_and_is_restored():
    """The rewrite runs after a hook the user set, only on the named kernel compiled by the thread
    inside the block (another thread compiling meanwhile gets the user's hook alone), and the
    user's hook is back afterwards, also after an exception."""
    name = "tilelang_callback_cuda_postproc"
    hook = lambda: tvm_ffi.get_global_func(name)  # noqa: E731
    tvm_ffi.register_global_func(name, f=lambda code, target: code + "// user", override=True)
    try:
        with patches.cuda_postproc(lambda code: code + "// ours", "kernel_a"):
            assert hook()("kernel_a", None) == "kernel_a// user// ours"
            assert hook()("kernel_b", None) == "kernel_b// user"
            other = []
            worker = threading.Thread(target=lambda: other.append(hook()("kernel_a", None)))
            worker.start()
            worker.join()
            assert other == ["kernel_a// user"]
            with patches.cuda_postproc(lambda code: code + "// inner", "kernel_a"):  # nested: no deadlock
                assert hook()("kernel_a", None) == "kernel_a// user// inner"
        assert hook()("kernel_a", None) == "kernel_a// user"
        with pytest.raises(RuntimeError):
            with patches.cuda_postproc(lambda code: code + "// ours", "kernel_a"):
                raise RuntimeError("compile failed")
        assert hook()("kernel_a", None) == "kernel_a// user"
    finally:
        tvm_ffi.remove_global_func(name)
    with patches.cuda_postproc(lambda code: code, "kernel_a"):
        pass
    assert tvm_ffi.get_global_func(name, allow_missing=True) is None
