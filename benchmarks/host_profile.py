"""Where the host time of one call goes: per-call wall time of each stage, then cProfile's top entries.

Usage (GPU): python benchmarks/host_profile.py --case 3 --backend tilelang
"""
import argparse
import cProfile
import pstats
import torch

from flashdecode import flash_decode_with_kvcache, hardware, planner
from flashdecode.api import _kernel_module, run_kernels
from flashdecode.bench.timing import Timer
from flashdecode.cases import CASES_BY_NUMBER, make_inputs
from flashdecode.validate import validate


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", type=int, default=3)
    parser.add_argument("--backend", default="tilelang")
    args = parser.parse_args()
    q, k, v, seqlens = make_inputs(CASES_BY_NUMBER[args.case], device="cuda")
    problem, _ = validate(q, k, v, seqlens, None, 0, args.backend, None)
    plan = planner.plan(problem, hardware.profile_for(q.device))
    out, lse = torch.empty_like(q), torch.empty((problem.batch, problem.nheads), device="cuda")
    rows = plan.programs_per_head if plan.needs_combine else 0
    part_o = torch.empty((rows, problem.nheads, problem.headdim), device="cuda")
    part_lse = torch.empty((rows, problem.nheads), device="cuda")
    launch = _kernel_module(args.backend).run
    stages = {
        "whole call": lambda: flash_decode_with_kvcache(q, k, v, seqlens, backend=args.backend),
        "validate": lambda: validate(q, k, v, seqlens, None, 0, args.backend, None),
        "plan": lambda: planner.plan(problem, hardware.profile_for(q.device)),
        "run_kernels": lambda: run_kernels(args.backend, plan, problem, q, k, v, seqlens, 0.088),
        "launches only": lambda: launch(plan, problem, q, k, v, seqlens, out, lse, part_o, part_lse, 0.088),
        "torch.empty x1": lambda: torch.empty(16, device="cuda"),
    }
    if args.backend == "tilelang" and plan.needs_combine:  # each of the two launches of a split call
        from flashdecode.kernels.tilelang import decode

        split, combine = decode.launchers_for(problem, plan, hardware.profile_for(q.device))
        stages["split launch"] = lambda: split(q, k, v, seqlens, out, lse, part_o, part_lse, plan.programs_per_head,
                                               plan.forced_splits, plan.min_chunk, 0.088)
        stages["combine launch"] = lambda: combine(seqlens, part_o, part_lse, out, lse, problem.seqlen_cache,
                                                   plan.programs_per_head, plan.forced_splits, plan.min_chunk)
    timer = Timer(q.device, iters=1, warmup=1, cold_l2=False)
    for name, fn in stages.items():
        fn()  # warm-up: compiles and caches out of the figure
        print(f"{args.backend} case {args.case} {name:16s} {timer.host_overhead_us(fn, 2000):8.2f} us/call",
              flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        stages["whole call"]()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
