"""Where a call's host time goes on the compiled host path (GPU machine): one plain torch launch,
`torch.empty_like`, the capture check, the default-context lookup, then per backend the whole call
and the C++ part alone (`HostPath.run`: lookup, allocation, launches); the difference is the Python
before it. Calls back to back, no waiting on the GPU (a case whose GPU time exceeds its host time
shows the GPU instead).

``--busy``: each timed loop starts behind one long matmul (about 10 ms on an H200; a loop that
outlasts it stops the run: take ``--calls 200``), so its calls are queued behind work, as a case's
calls are once their GPU time exceeds their host time (the bench's host figure for cases 7-14);
without it the queue drains between calls of the small cases.

Usage: python benchmarks/host_profile.py [--cases 3,10,8] [--calls 3000] [--backends tilelang,triton] [--busy]
"""
import argparse
import statistics
import time

import torch

import flashdecode
from flashdecode import compat
from flashdecode.bench.timing import Timer
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call
from flashdecode.context import default_context


BUSY = {"on": False}


def per_call(timer: Timer, function, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the benchmark's host time per call (``Timer.host_overhead_us``), in us;
    with ``--busy`` each loop behind one queued long matmul."""
    samples = []
    for _ in range(repeats):
        if BUSY["on"]:
            timer.synchronize()
            BUSY["a"] @ BUSY["a"]
            queued = torch.cuda.Event()
            queued.record()
            samples.append(timed_without_sync(function, calls))
            if queued.query():  # the matmul ended before the loop did: part of it was timed idle
                raise SystemExit(f"--busy: {calls} calls outlast the queued matmul; take fewer (--calls 200)")
        else:
            samples.append(timer.host_overhead_us(function, calls))
    return statistics.median(samples)


def timed_without_sync(function, calls: int) -> float:
    """Host us per call of ``calls`` calls back to back, the queue left as it is (``--busy``)."""
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="3,10,8")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--backends", default="tilelang,triton")
    parser.add_argument("--busy", action="store_true", help="time each loop behind a queued long matmul")
    args = parser.parse_args()
    if args.busy:
        BUSY.update(on=True, a=torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16))
    for number in (int(text) for text in args.cases.split(",")):
        call = make_call(CASES_BY_NUMBER[number], VARIANTS["plain"], "cuda")
        q, k_cache, v_cache, lengths = call.q, call.k_cache, call.v_cache, call.kwargs()["cache_seqlens"]
        index = q.device.index or 0
        timer = Timer(q.device, iters=1, warmup=0, cold_l2=False)
        print(f"case {number}: q.add_(0) {per_call(timer, lambda: q.add_(0), args.calls):.1f}  "
              f"empty_like {per_call(timer, lambda: torch.empty_like(q), args.calls):.1f}  "
              f"is_capturing {per_call(timer, torch.cuda.is_current_stream_capturing, args.calls):.1f}  "
              f"default_context {per_call(timer, lambda: default_context(q), args.calls):.2f}")
        for backend in args.backends.split(","):
            def whole():
                return flashdecode.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, backend=backend)

            for _ in range(5):
                whole()  # the first records its launches
            host = default_context(q).host_path
            if host is None:
                print(f"  {backend:8s} no host path: {flashdecode.host_path.unavailable()}")
                continue
            arguments = (q, k_cache, v_cache, None, None, None, None, lengths, None, None, None, None, False, (-1, -1),
                         0.0, True, None, 0, False, backend, None, compat.current_stream_handle(index))
            hits = host.hits
            whole_us = per_call(timer, whole, args.calls)
            native_us = per_call(timer, lambda: host.run(arguments), args.calls)
            print(f"  {backend:8s} whole call {whole_us:6.1f}  C++ part {native_us:6.1f}  "
                  f"python before it {whole_us - native_us:5.1f}  (host path hits +{host.hits - hits})")


if __name__ == "__main__":
    main()
