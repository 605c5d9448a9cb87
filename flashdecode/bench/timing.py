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
import itertools
import time
from typing import Callable

import numpy as np
import torch

#: The flush is at least this large, whatever the L2: the anchor timings (``data/h200-peers.json``)
#: zeroed 256 MB before every run.
MIN_FLUSH_BYTES = 256 * 1024 * 1024
#: Replays of a captured graph before its warm-up and timed runs: on the H200 the first graph timed
#: on a case's inputs read 2-3 µs high (47.9 against 45.0 µs on 2 x 16384 tokens) for its first 25
#: replays and not after (``docs/design.md``, "The benchmark").
GRAPH_WARMUP = 50
#: Rounds a series of several functions is timed in (``Timer.interleaved``), each function a block
#: of consecutive runs per round. On the H200, alternating every run among the 8 systems of the
#: committed run put 1-1.6 µs on the graph replays of cases 1-3 (a different graph each launch) and
#: multiplied the cold medians of host-heavy peers (SDPA 158 -> 461 µs on case 1).
INTERLEAVE_ROUNDS = 5


def round_blocks(runs: int, rounds: int = INTERLEAVE_ROUNDS) -> list[int]:
    """``runs`` split into at most ``rounds`` blocks of consecutive runs, the last one shorter where
    they do not divide: the block each function runs per round of an interleaved series."""
    size = -(-runs // rounds)
    return [min(size, runs - start) for start in range(0, runs, size)]


class CallFailed(Exception):
    """Function ``index`` of an interleaved series raised ``error``."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(f"function {index}: {type(error).__name__}: {error}")
        self.index = index
        self.error = error


def _call(index: int, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - re-raised with the function's index
        raise CallFailed(index, error) from error


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
        try:
            return self.interleaved([fn])[0]
        except CallFailed as failure:
            raise failure.error

    def interleaved(self, fns: list[Callable[[], object]]) -> list[list[float]]:
        """The ``iters`` run times (µs) of each of ``fns``, in ``INTERLEAVE_ROUNDS`` rounds: each
        round runs every function a block of consecutive runs (the warm-up a block of its own
        first), so a drift over the series (the clocks, a transient after new inputs) falls on
        every function alike, while only a block's first run follows another function's. A
        function that raises ends the series with ``CallFailed`` naming it."""
        for index, fn in enumerate(fns):
            for _ in range(self.warmup):
                self._flush()
                _call(index, fn)
        sizes = round_blocks(self.iters)
        blocks = list(zip(itertools.accumulate(sizes, initial=0), sizes))  # (first run, runs) a round
        if not self.cuda:
            samples = [[] for _ in fns]
            for _, runs in blocks:
                for index, fn in enumerate(fns):
                    for _ in range(runs):
                        start = time.perf_counter()
                        _call(index, fn)
                        samples[index].append((time.perf_counter() - start) * 1e6)
            return samples
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.iters)] for _ in fns]
        for first, runs in blocks:
            for index, fn in enumerate(fns):
                for start, end in events[index][first:first + runs]:
                    self._flush()
                    start.record()
                    _call(index, fn)
                    end.record()
        self.synchronize()
        return [[start.elapsed_time(end) * 1e3 for start, end in pairs] for pairs in events]

    def time_graph(self, fn: Callable[[], object]):
        """``time_graphs`` of ``fn`` alone."""
        try:
            return self.time_graphs([fn])[0]
        except CallFailed as failure:
            raise failure.error

    def time_graphs(self, fns: list[Callable[[], object]]) -> list:
        """Capture each of ``fns`` once in a CUDA graph and time their replays (same flush, same
        events, in rounds as ``interleaved`` times) after ``GRAPH_WARMUP`` replays each.

        Returns, per function, (Timing, the graph's output) so the replayed result can be checked,
        or None when there is no CUDA or its capture fails (some peers cannot be captured). Call
        after warm-up: nothing may compile or allocate lazily during capture.
        """
        captured = [self.capture(fn) for fn in fns]
        replays = [(index, found[0].replay) for index, found in enumerate(captured) if found is not None]
        try:
            timed = self.replays([replay for _, replay in replays])
        except CallFailed as failure:  # name the function, not its place among the captured ones
            raise CallFailed(replays[failure.index][0], failure.error) from failure.error
        results = [None] * len(fns)
        for (index, _), samples in zip(replays, timed):
            results[index] = summarize(samples), captured[index][1]
        return results

    def replays(self, replays: list[Callable[[], object]]) -> list[list[float]]:
        """``interleaved`` run times (µs) of captured graphs' ``replay``s, after ``GRAPH_WARMUP``
        flushed replays each."""
        for index, replay in enumerate(replays):
            for _ in range(GRAPH_WARMUP):
                self._flush()
                _call(index, replay)
        return self.interleaved(replays)

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
        """``host_times`` of ``fn`` alone."""
        return self.host_times([fn], calls, loops)[0]

    def host_times(self, fns: list[Callable[[], object]], calls: int = 200, loops: int = 5) -> list[float]:
        """Host time per call (validation, planning, launch) of each of ``fns``: the median over
        ``loops`` loops of ``calls`` calls back to back, each loop's time divided by ``calls``, no
        sync inside a loop (the device work it queues is waited for between loops, not timed).
        The functions' loops alternate, so a reference timed with a call sees the same host speed."""
        samples = [[] for _ in fns]
        for _ in range(loops):
            for index, fn in enumerate(fns):
                self.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[index].append((time.perf_counter() - start) / calls * 1e6)
        self.synchronize()
        return [float(np.median(series)) for series in samples]
