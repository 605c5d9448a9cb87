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


class HostClock:
    """Host time per call of a function, in us: the median over ``repeats`` loops of ``calls`` calls
    back to back, each loop as the benchmark times it (``Timer.host_overhead_us``), or with ``busy``
    (a square matrix) behind one queued matmul of it, its queue left as it is."""

    def __init__(self, timer: Timer, calls: int, busy: torch.Tensor | None = None, repeats: int = 5):
        self.timer, self.calls, self.busy, self.repeats = timer, calls, busy, repeats

    def per_call(self, function) -> float:
        loop = self.timer.host_overhead_us if self.busy is None else self._behind_matmul
        return statistics.median(loop(function, self.calls) for _ in range(self.repeats))

    def _behind_matmul(self, function, calls: int) -> float:
        self.timer.synchronize()
        self.busy @ self.busy
        queued = torch.cuda.Event()
        queued.record()
        start = time.perf_counter()
        for _ in range(calls):
            function()
        elapsed = time.perf_counter() - start
        if queued.query():  # the matmul ended before the loop did: part of it was timed idle
            raise SystemExit(f"--busy: {calls} calls outlast the queued matmul; take fewer (--calls 200)")
        return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="3,10,8")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--backends", default="tilelang,triton")
    parser.add_argument("--busy", action="store_true", help="time each loop behind a queued long matmul")
    args = parser.parse_args()
    busy = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16) if args.busy else None
    for number in (int(text) for text in args.cases.split(",")):
        call = make_call(CASES_BY_NUMBER[number], VARIANTS["plain"], "cuda")
        q, k_cache, v_cache, lengths = call.q, call.k_cache, call.v_cache, call.kwargs()["cache_seqlens"]
        index = q.device.index or 0
        clock = HostClock(Timer(q.device, iters=1, warmup=0, cold_l2=False), args.calls, busy)
        print(f"case {number}: q.add_(0) {clock.per_call(lambda: q.add_(0)):.1f}  "
              f"empty_like {clock.per_call(lambda: torch.empty_like(q)):.1f}  "
              f"is_capturing {clock.per_call(torch.cuda.is_current_stream_capturing):.1f}  "
              f"default_context {clock.per_call(lambda: default_context(q)):.2f}")
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
            whole_us = clock.per_call(whole)
            native_us = clock.per_call(lambda: host.run(*arguments))
            print(f"  {backend:8s} whole call {whole_us:6.1f}  C++ part {native_us:6.1f}  "
                  f"python before it {whole_us - native_us:5.1f}  (host path hits +{host.hits - hits})")


if __name__ == "__main__":
    main()
