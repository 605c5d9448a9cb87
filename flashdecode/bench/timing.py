"""The one timing helper of the benchmark and the profiler.

On CUDA every timed run is bracketed by CUDA events, and by default preceded by zeroing a buffer
larger than the L2 cache (cold L2), so each run reads K/V from HBM as a decode step in a real model
does. The second figure, a replay of the call captured in a CUDA graph, removes host launch time,
which dominates the small cases. The third, host time per call, is the host's side alone; the
fourth, the eager loop, is what a model running eagerly sees: one call per layer back to back, host
launches overlapping the GPU work of the calls before. Without CUDA the same loops time with
``time.perf_counter``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import torch

#: The flush is at least this large, whatever the L2: the anchor timings (``data/h200-peers.json``)
#: zeroed 256 MB before every run.
MIN_FLUSH_BYTES = 256 * 1024 * 1024
#: Replays of a captured graph before its warm-up and timed runs: on the H200 the first graph timed
#: on a case's inputs read 2-3 µs high (47.9 against 45.0 µs on 2 x 16384 tokens) for its first 25
#: replays and not after (``docs/benchmarks.md``, "Timing"; one excess it does not remove is there too).
GRAPH_WARMUP = 50


@dataclasses.dataclass(frozen=True)
class Timing:
    """Summary of one series of timed runs, in microseconds."""

    median_us: float
    min_us: float
    p80_us: float
    runs: int


def summarize(samples_us) -> Timing:
    """Median, minimum and 80th percentile (linear interpolation) of a series of run times."""
    samples = np.asarray(samples_us, dtype=np.float64)
    if samples.size == 0:
        raise ValueError("summarize needs at least one sample")
    return Timing(float(np.median(samples)), float(samples.min()), float(np.percentile(samples, 80)),
                  int(samples.size))


class Timer:
    """Times callables on one device: ``warmup`` untimed runs, then ``iters`` timed runs.

    ``cold_l2``: on CUDA, zero a buffer of max(2 x L2, 256 MB) before every run (warm-up included)
    so no run finds its inputs in L2. Ignored on CPU, where there is nothing comparable to flush.
    """

    def __init__(self, device: torch.device, iters: int, warmup: int, cold_l2: bool = True):
        if iters < 1 or warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
        self.device = torch.device(device)
        self.iters = iters
        self.warmup = warmup
        self.cuda = self.device.type == "cuda"
        self.flush_bytes = 0
        self._flush_buffer = None
        if self.cuda and cold_l2:
            from .. import hardware

            self.flush_bytes = max(2 * hardware.current(self.device.index).l2_bytes, MIN_FLUSH_BYTES)
            self._flush_buffer = torch.empty(self.flush_bytes, dtype=torch.uint8, device=self.device)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _flush(self) -> None:
        if self._flush_buffer is not None:
            self._flush_buffer.zero_()

    def time(self, fn: Callable[[], object]) -> Timing:
        """Time ``fn()``; each timed run covers ``fn`` only, never the flush before it."""
        return summarize(self.samples(fn))

    def samples(self, fn: Callable[[], object]) -> list[float]:
        """The ``iters`` run times of ``fn()`` (µs), in the order they ran, after the warm-up."""
        for _ in range(self.warmup):
            self._flush()
            fn()
        if not self.cuda:
            samples = []
            for _ in range(self.iters):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e6)
            return samples
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
        for start, end in events:
            self._flush()
            start.record()
            fn()
            end.record()
        self.synchronize()
        return [start.elapsed_time(end) * 1e3 for start, end in events]

    def time_graph(self, fn: Callable[[], object]):
        """Capture ``fn()`` once in a CUDA graph and time its replays (same flush, same events)
        after ``GRAPH_WARMUP`` replays.

        Returns (Timing, the graph's output) so the replayed result can be checked, or None when
        there is no CUDA or the capture fails (some peers cannot be captured). Call after warm-up:
        nothing may compile or allocate lazily during capture.
        """
        captured = self.capture(fn)
        if captured is None:
            return None
        graph, out = captured
        for _ in range(GRAPH_WARMUP):
            self._flush()
            graph.replay()
        return self.time(graph.replay), out

    def capture(self, fn: Callable[[], object]):
        """(graph, output) of ``fn()`` captured once in a CUDA graph, or None without CUDA or when
        the capture fails."""
        if not self.cuda:
            return None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = fn()
        except Exception:  # noqa: BLE001 - any capture failure means "no graph figure"
            return None
        return graph, out

    def eager_loop(self, calls: list[Callable[[], object]], repeats: int) -> Timing:
        """Time per call of ``calls`` (one per layer, each on its own inputs) run back to back:
        one loop untimed, then ``repeats`` loops, each after the flush (the first layer finds L2 as
        a model's attention does, after other layers' weights went through it) with one pair of
        events around the whole loop and no sync inside. Summarizes loop time / len(calls)."""
        for fn in calls:
            fn()
        samples = []
        for _ in range(repeats):
            self._flush()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for fn in calls:
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / len(calls))
            else:
                begin = time.perf_counter()
                for fn in calls:
                    fn()
                samples.append((time.perf_counter() - begin) * 1e6 / len(calls))
        return summarize(samples)

    def host_overhead_us(self, fn: Callable[[], object], calls: int = 200, loops: int = 5) -> float:
        """Host time per call (validation, planning, launch): the median over ``loops`` loops of
        ``calls`` calls back to back, each loop's time divided by ``calls``, no sync inside a loop
        (the device work it queues is waited for between loops, not timed)."""
        samples = []
        for _ in range(loops):
            self.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls * 1e6)
        self.synchronize()
        return float(np.median(samples))
