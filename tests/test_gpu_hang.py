"""Regression test of the TileLang split kernel's GPU hang (``docs/design.md``, "Dependencies").

TileLang 0.1.15 runs the warp-specialised producer loop on all four producer warps; warps 1-3 only
watch the "stage free" barriers, and one that falls two phases behind waits forever. The shipped
kernel runs the loop on one warp (``patches.one_warp_producer``). This test builds case 12's split
kernel with a ~1 ms sleep injected into warps 1-3 at the loop's first iteration, which would put
them many phases behind, and checks that 100 calls still end (in a subprocess with a time limit:
a hung kernel is only cleared by its process's exit) with the right result.
"""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
LAG = "if (((int)threadIdx.x) >= 32 && kb == blk_lo) { for (int z = 0; z < 20; ++z) __nanosleep(50000); }\n"
LOOP_BODY = "++kb) {\n"


def inject_lag(code: str) -> str:
    at = code.index(LOOP_BODY) + len(LOOP_BODY)  # the first loop over kb is the producer's
    return code[:at] + LAG + code[at:]


def lagged_calls(calls: int) -> float:
    """Case 12 through a split kernel whose producer warps 1-3 lag; returns the rel. error."""
    import tilelang
    import torch

    import flashdecode
    from flashdecode.cases import CASES_BY_NUMBER, make_inputs
    from flashdecode.hardware import current
    from flashdecode.kernels import get_backend
    from flashdecode.kernels.tilelang import build, kernels, occupancy, patches
    from flashdecode.kernels.tilelang.config import KernelShape
    from flashdecode.reference import reference_decode, relative_error

    q, k, v, seqlens = make_inputs(CASES_BY_NUMBER[12], device="cuda")
    route = flashdecode.plan_for(q, k, v, cache_seqlens=seqlens, backend="tilelang")
    problem, plan, profile = route.problem, route.plan, current()
    shape = KernelShape.of(problem)
    resident = occupancy.resident_programs(shape, plan.config, profile)
    func = kernels.split_kernel(shape, plan.config, True, resident,
                                occupancy.register_split(plan.config, resident, profile))
    with patches.cuda_postproc(lambda code: inject_lag(patches.one_warp_producer(code)), kernels.SPLIT_KERNEL_NAME):
        split = tilelang.compile(func, target=build.device_target(), execution_backend="tvm_ffi",
                                 compile_flags=[*patches.COMPILE_FLAGS, "-DFLASHDECODE_LAG_CHECK=1"])
    assert "__nanosleep(50000)" in split.get_kernel_source() and patches.is_rewritten(split.get_kernel_source())
    combine = get_backend("tilelang").compiled("combine", problem, plan.config, profile, build.device_target())
    context = flashdecode.DecodeContext("cuda")
    out = torch.empty_like(q)
    lse = torch.empty(problem.batch, problem.nheads, dtype=torch.float32, device="cuda")
    part_o, part_lse = context.workspace.partials(plan, problem, q.device)
    for _ in range(calls):
        split(q, k, v, seqlens, out, lse, part_o, part_lse, plan.programs_per_head, plan.forced_splits,
              plan.min_chunk, problem.headdim ** -0.5)
        combine(seqlens, part_o, part_lse, out, lse, problem.seqlen_cache, plan.programs_per_head,
                plan.forced_splits, plan.min_chunk)
    torch.cuda.synchronize()
    return relative_error(out, reference_decode(q, k, v, seqlens)[0])


def test_lagging_producer_warps_do_not_hang_the_split_kernel():
    pytest.importorskip("tilelang")
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert float(result.stdout.split()[-1]) < 1e-2


if __name__ == "__main__":
    print(f"rel. error {lagged_calls(100):.3e}")
