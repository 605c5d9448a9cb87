"""The split-KV planner: pure Python, no device access.

Decode attention reads every cached K/V token once and does little arithmetic per byte, so the
kernel is bound by memory bandwidth, and the schedule's job is to keep every multiprocessor
streaming until the end. One program (CTA) handles one KV head of one *split* (a contiguous run
of KV blocks of one sequence) for the whole GQA group, so each K/V tile is read once per KV head.

The schedule is decided in two steps.

1. On the host, from capacities only (:func:`plan`): batch, ``seqlen_cache``, heads, head dim,
   dtype and the hardware profile give the tile size ``block_n`` and ``programs_per_head`` (P),
   the number of programs launched per KV head. Nothing here reads ``cache_seqlens``, so a call
   never waits for the device and can be captured in a CUDA graph; a new batch size or new lengths
   only change P, never the compiled kernel.

   * No split (P = B, no combine pass) when no sequence can be longer than ``SPLIT_ABOVE_BLOCKS``
     blocks: a combine pass would cost more than the split saves.
   * Otherwise, even when B * Hk already fills the machine (one long sequence among short ones
     would still leave a tail), P = B + floor(target_programs / Hk): one program per sequence plus
     enough extra to fill, without exceeding, ``target_programs`` = multiprocessors * programs per
     multiprocessor. Sequences of mixed lengths split into programs of unequal work, and finer
     programs balance better: ``PROGRAMS_PER_MULTIPROCESSOR`` (3). One sequence (B = 1) splits
     into programs of equal work, which run in whole waves of the backend's resident programs, so
     there the target is at most one wave: min(3, resident programs per multiprocessor).

2. On the device, from the real lengths (:func:`work_list` is the same rule in Python; the kernels
   evaluate it in each program from ``cache_seqlens``, a few integer operations per sequence):

   * nblk_b   = ceil(len_b / block_n)
   * chunk    = max(m, ceil(sum_b nblk_b / (P - B)))           (blocks per program, at most)
   * splits_b = max(1, ceil(nblk_b / chunk))                  (sum_b splits_b <= P, proven below)
   * program p serves the sequence b whose programs [first_b, first_b + splits_b) contain p,
     and the blocks [s * nblk_b // splits_b, (s + 1) * nblk_b // splits_b) with s = p - first_b;
     programs past sum_b splits_b exit at once.

   where m = ``min_chunk`` (``MIN_BLOCKS_PER_SPLIT``) keeps splits long enough that a program's
   fixed cost and the combine pass stay small next to its streaming.
   Since ceil(x) < x + 1, sum_b splits_b <= sum_b nblk_b / chunk + B <= (P - B) + B = P.
   Every program carries at most ``chunk`` blocks, about the mean work per program, whatever the
   mix of lengths: a 65k-token sequence among short ones is cut into many splits, short sequences
   get one each, so no program is left with a long tail. Sequences that end up with one split write
   their output directly; the combine pass merges the others.

A forced ``num_splits = F > 0`` (for tests and tuning) gives splits_b = min(F, max(1, nblk_b))
and P = B * F, F first capped at the blocks of a full-length sequence.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from .hardware import HardwareProfile

#: Programs aimed for per multiprocessor when splitting a batch. A tuning knob measured on the
#: H200 (docs/perf-log.md section 12), not a hardware fact.
PROGRAMS_PER_MULTIPROCESSOR = 3
#: Fewest KV blocks a split may carry (unless the sequence is shorter). Tuning knob, measured.
MIN_BLOCKS_PER_SPLIT = 4
#: Caches of at most this many KV blocks are never split. Tuning knob, measured.
SPLIT_ABOVE_BLOCKS = 8
#: Resident split programs per multiprocessor assumed when no backend is named (plan-only
#: reports, tests): TileLang's count for the benchmark's kernels (two per SM).
ASSUMED_RESIDENT_PROGRAMS = 2
#: Pipeline depth the shared-memory budget for K/V tiles is sized for.
PIPELINE_STAGES = 2
#: Programs that should fit in one multiprocessor's shared memory at once.
RESIDENT_PROGRAMS_FOR_SMEM = 2

#: KV tile sizes, largest first (tuning knob; 16 is the smallest the matrix units take).
BLOCK_N_CANDIDATES = (64, 32, 16)

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shape of one decode call, as validated from its tensors."""

    batch: int
    seqlen_cache: int
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str  # "float16" | "bfloat16"

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs: tile size, grid, and whether a combine pass follows."""

    block_n: int
    programs_per_head: int  # P: grid is (P, nheads_k)
    forced_splits: int  # 0: balanced rule from the lengths; F > 0: every sequence split F ways
    can_split: bool  # False: one program per sequence, no combine pass
    min_chunk: int = 1  # fewest blocks per split under the balanced rule

    @property
    def needs_combine(self) -> bool:
        return self.can_split

    def grid(self, problem: Problem) -> tuple[int, int]:
        return (self.programs_per_head, problem.nheads_k)


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One program's slice of KV: sequence, split, and the token range it reads."""

    program: int
    sequence: int
    split: int
    num_splits: int
    token_start: int
    token_end: int

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start


def choose_block_n(problem: Problem, profile: HardwareProfile) -> int:
    """Largest KV tile whose pipelined K and V stages let two programs share a multiprocessor."""
    budget = profile.shared_memory_per_multiprocessor // RESIDENT_PROGRAMS_FOR_SMEM
    for block_n in BLOCK_N_CANDIDATES:
        stage_bytes = 2 * block_n * problem.headdim * problem.element_bytes  # K and V
        if PIPELINE_STAGES * stage_bytes <= budget:
            return block_n
    return BLOCK_N_CANDIDATES[-1]


@functools.lru_cache(maxsize=4096)
def plan(problem: Problem, profile: HardwareProfile, num_splits: int = 0,
         resident_programs: int = ASSUMED_RESIDENT_PROGRAMS) -> Plan:
    """Decide the schedule from capacities only (see the module docstring for the rule).

    ``resident_programs``: how many of the backend's split programs one multiprocessor holds at
    once (``api.plan_for`` asks the backend); it caps the target of a single sequence."""
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0, got {num_splits}")
    block_n = choose_block_n(problem, profile)
    batch, heads_k = problem.batch, problem.nheads_k
    if num_splits > 0:
        num_splits = min(num_splits, max(1, math.ceil(problem.seqlen_cache / block_n)))  # no empty splits
        return Plan(block_n, batch * num_splits, num_splits, can_split=num_splits > 1)
    max_blocks = math.ceil(problem.seqlen_cache / block_n)
    if max_blocks <= SPLIT_ABOVE_BLOCKS:
        return Plan(block_n, batch, 0, can_split=False)
    per_multiprocessor = PROGRAMS_PER_MULTIPROCESSOR if batch > 1 else min(PROGRAMS_PER_MULTIPROCESSOR,
                                                                          max(1, resident_programs))
    target_programs = profile.multiprocessors * per_multiprocessor
    extra = max(1, target_programs // heads_k)  # never more than the target
    return Plan(block_n, batch + extra, 0, can_split=True, min_chunk=MIN_BLOCKS_PER_SPLIT)


def splits_per_sequence(plan_: Plan, lengths: list[int]) -> list[int]:
    """splits_b for every sequence, exactly as the kernels compute it on the device."""
    blocks = [math.ceil(n / plan_.block_n) for n in lengths]
    if plan_.forced_splits > 0:
        return [min(plan_.forced_splits, max(1, nb)) for nb in blocks]
    if not plan_.can_split:
        return [1] * len(lengths)
    chunk = max(plan_.min_chunk, math.ceil(sum(blocks) / (plan_.programs_per_head - len(lengths))))
    return [max(1, math.ceil(nb / chunk)) for nb in blocks]


def work_list(plan_: Plan, lengths: list[int]) -> list[WorkItem]:
    """Every program's slice of KV for these lengths (one KV head; all heads are alike).

    Programs not listed exit without work. This mirrors the device code and is what the planner
    tests and the profiler's tail analysis reason about.
    """
    items = []
    program = 0
    for sequence, (length, splits) in enumerate(zip(lengths, splits_per_sequence(plan_, lengths))):
        blocks = math.ceil(length / plan_.block_n)
        for split in range(splits):
            start = split * blocks // splits * plan_.block_n
            end = min((split + 1) * blocks // splits * plan_.block_n, length)
            items.append(WorkItem(program, sequence, split, splits, start, end))
            program += 1
    if program > plan_.programs_per_head:
        raise AssertionError(f"work list needs {program} programs, plan launches {plan_.programs_per_head}")
    return items
