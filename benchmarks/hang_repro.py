"""Try to reproduce TileLang's intermittent GPU hang (perf log 16) and say which kernel hangs.

Loops one matrix case's TileLang call back to back for ``--seconds``, synchronising every
``--every`` calls; a watchdog thread dumps every Python thread's stack and exits with code 3 (a
hang; 0: none) when one synchronisation takes longer than ``--timeout`` seconds. Should the wait
hold the GIL, faulthandler dumps the stacks 10 s later and exits with 1, after a "Timeout" line. ``--kernels split`` launches only the
split kernel (into the partials), ``combine`` only the combine kernel over partials made once,
``both`` the whole call. Prints calls made and the outcome.

Usage (GPU): python benchmarks/hang_repro.py --case 13 --kernels both --seconds 120
"""
import argparse
import faulthandler
import os
import sys
import threading
import time

import torch

from flashdecode import api, hardware
from flashdecode.cases import CASES_BY_NUMBER, make_inputs
from flashdecode.kernels.tilelang import decode
from flashdecode.validate import validate


HANG_EXIT_CODE = 3


def watchdog(synchronised: threading.Event, timeout: float, what: str) -> None:
    """Wait for one synchronisation; past ``timeout``, dump every thread's stack and exit 3."""
    if not synchronised.wait(timeout):
        print(f"HANG: no synchronisation within {timeout} s {what}", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(HANG_EXIT_CODE)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", type=int, default=13)
    parser.add_argument("--kernels", choices=("both", "split", "combine"), default="both")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=20)
    args = parser.parse_args()
    q, k, v, seqlens = make_inputs(CASES_BY_NUMBER[args.case], device="cuda")
    problem, _ = validate(q, k, v, seqlens, None, 0, "tilelang", None)
    profile = hardware.profile_for(q.device)
    plan = api.plan_for("tilelang", problem, profile)
    if not plan.needs_combine and args.kernels != "both":
        sys.exit(f"case {args.case} never splits: only --kernels both applies")
    split, combine = decode.launchers_for(problem, plan, profile)
    out, lse = torch.empty_like(q), torch.empty((problem.batch, problem.nheads), device="cuda")
    part_o, part_lse = api._partials(plan.programs_per_head, problem.nheads, problem.headdim, q.device)
    scale = problem.headdim ** -0.5
    launches = {
        "both": lambda: api.flash_decode_with_kvcache(q, k, v, seqlens, backend="tilelang"),
        "split": lambda: split(q, k, v, seqlens, out, lse, part_o, part_lse, plan.programs_per_head,
                               plan.forced_splits, plan.min_chunk, scale),
        "combine": lambda: combine(seqlens, part_o, part_lse, out, lse, problem.seqlen_cache,
                                   plan.programs_per_head, plan.forced_splits, plan.min_chunk),
    }
    if args.kernels == "combine":
        launches["split"]()  # real partials for the combine kernel to merge
    launch = launches[args.kernels]
    torch.cuda.synchronize()
    calls, start = 0, time.perf_counter()
    print(f"case {args.case} kernels {args.kernels} plan {plan}", flush=True)
    while time.perf_counter() - start < args.seconds:
        for _ in range(args.every):
            launch()
        calls += args.every
        synchronised = threading.Event()
        threading.Thread(target=watchdog, args=(synchronised, args.timeout, f"after {calls} calls"),
                         daemon=True).start()
        # Backstop should the wait hold the GIL: faulthandler's own thread dumps and exits (code 1).
        faulthandler.dump_traceback_later(args.timeout + 10, exit=True)
        torch.cuda.synchronize()
        synchronised.set()
        faulthandler.cancel_dump_traceback_later()
    print(f"no hang: {calls} calls in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
