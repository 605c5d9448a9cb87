"""Dimensions 1 and 2 from the plan alone: grid, programs per multiprocessor, waves, work per program.

Every KV head runs the same work list (``planner.work_list``), so the whole grid is that list
repeated ``nheads_k`` times, in launch order (blockIdx.x fastest). The tail figures come from a
model of the block scheduler: each program starts on the first free slot (one of multiprocessors x
resident programs) in launch order and runs for a time proportional to its tokens. The model
counts idle slots, not lost time: a memory-bound kernel with idle slots streams faster per program,
so the measured time (dimension 2's ceiling figures) is the judge.
"""
from __future__ import annotations

import heapq
import statistics

from .. import planner
from ..hardware import HardwareProfile


def schedule(work: list[float], slots: int) -> tuple[float, float]:
    """(idle fraction of the whole run, idle fraction of its last wave) for programs of the given
    work started in order on the first free of ``slots``. The last wave runs from the start of the
    last program with work to the end; (0, 0) when no program has work."""
    free = [0.0] * slots
    spans = []
    for amount in work:
        start = heapq.heappop(free)
        heapq.heappush(free, start + amount)
        if amount > 0:
            spans.append((start, start + amount))
    if not spans:
        return 0.0, 0.0
    finish = max(end for _, end in spans)
    last_start = max(start for start, _ in spans)
    idle = 1.0 - sum(end - start for start, end in spans) / (slots * finish)
    busy_last = sum(end - max(start, last_start) for start, end in spans if end > last_start)
    return idle, 1.0 - busy_last / (slots * (finish - last_start))


def occupancy(problem: planner.Problem, plan: planner.Plan, lengths: list[int], profile: HardwareProfile,
              resident: int) -> dict:
    """Dimension 1 from the plan: grids, programs with work, programs per SM and waves (of the launched
    grid, and of the programs with work: the rest exit at once)."""
    grid = plan.grid(problem)
    launched = grid[0] * grid[1]
    with_work = len(planner.work_list(plan, lengths)) * problem.nheads_k
    slots = profile.multiprocessors * resident
    return {
        "block_n": plan.block_n,
        "grid": list(grid),
        "combine_grid": [problem.batch, problem.nheads] if plan.needs_combine else None,
        "programs_launched": launched,
        "programs_with_work": with_work,
        "multiprocessors": profile.multiprocessors,
        "programs_per_sm": with_work / profile.multiprocessors,
        "resident_programs_per_sm": resident,
        "waves": launched / slots,
        "waves_with_work": with_work / slots,
    }


def tail(problem: planner.Problem, plan: planner.Plan, lengths: list[int], profile: HardwareProfile,
         resident: int) -> dict:
    """Dimension 2 from the plan: tokens per program and the scheduler model's idle fractions."""
    items = planner.work_list(plan, lengths)
    tokens = [item.tokens for item in items]
    per_head = tokens + [0] * (plan.programs_per_head - len(items))  # programs past the list exit at once
    slots = profile.multiprocessors * resident
    idle, last_idle = schedule(per_head * problem.nheads_k, slots)
    mean = statistics.fmean(tokens)
    return {
        "programs_per_head": plan.programs_per_head,
        "programs_with_work_per_head": len(items),
        "tokens_min": min(tokens),
        "tokens_mean": mean,
        "tokens_max": max(tokens),
        "max_over_mean_work": max(tokens) / mean if mean else None,
        "slots": slots,
        "idle_fraction": idle,
        "last_wave_idle_fraction": last_idle,
    }
