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

import tilelang_case
from flashdecode import api
from flashdecode.kernels.tilelang import decode


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
    call = tilelang_case.split_call(args.case)
    if not call.plan.needs_combine and args.kernels != "both":
        sys.exit(f"case {args.case} never splits: only --kernels both applies")
    split, combine = decode.launchers_for(call.problem, call.plan, call.profile)
    launches = {
        "both": lambda: api.flash_decode_with_kvcache(call.q, call.k, call.v, call.seqlens, backend="tilelang"),
        "split": lambda: split(*call.split_args()),
        "combine": lambda: combine(*call.combine_args()),
    }
    if args.kernels == "combine":
        launches["split"]()  # real partials for the combine kernel to merge
    launch = launches[args.kernels]
    torch.cuda.synchronize()
    calls, start = 0, time.perf_counter()
    print(f"case {args.case} kernels {args.kernels} plan {call.plan}", flush=True)
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
