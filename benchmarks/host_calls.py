"""Host time of the plain call against one plain torch launch, in one process (GPU machine): for each
(case, backend), loops of CALLS calls back to back of ``flash_attn_with_kvcache`` (no context) and
of ``q.add_(0)``, alternating, the median loop of each and their ratio (issue 14's host target is
1.5x). Only public names: the same script times an earlier tree (``PYTHONPATH=.before``), so a
before/after pair runs on one machine in one call.

Usage: python benchmarks/host_calls.py [--pairs 3:triton,6:triton,10:triton] [--calls 2000] [--loops 7]
"""
import argparse
import statistics
import time

import torch

import flashdecode
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call


def loop_us(function, calls: int) -> float:
    """Host time per call of ``calls`` calls back to back, in us (the GPU waited for around the loop):
    one loop of ``Timer.host_overhead_us``, kept here because an earlier tree's Timer takes no loop
    count and this script must time both alike."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="3:triton,3:tilelang,6:triton,10:triton")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--loops", type=int, default=7)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    scratch = torch.zeros(1024, device="cuda")
    for pair in args.pairs.split(","):
        number, backend = pair.split(":")
        call = make_call(CASES_BY_NUMBER[int(number)], VARIANTS["plain"], "cuda")
        q, k_cache, v_cache, lengths = call.q, call.k_cache, call.v_cache, call.kwargs()["cache_seqlens"]

        def whole():
            return flashdecode.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend=backend)

        for _ in range(5):
            whole()  # the first records its launches
        launches, calls = [], []
        for _ in range(args.loops):
            launches.append(loop_us(lambda: scratch.add_(0), args.calls))
            calls.append(loop_us(whole, args.calls))
        launch, whole_call = statistics.median(launches), statistics.median(calls)
        print(f"{args.label} case {int(number):2d} {backend:8s} torch launch {launch:5.2f} us | plain call "
              f"{whole_call:5.2f} us | ratio {whole_call / launch:4.2f}", flush=True)


if __name__ == "__main__":
    main()
