"""The planner: which kernel runs, with which tile config and grid. Pure Python, no device access.

Decode attention reads every cached K/V token once and does little arithmetic per byte, so the
kernel is bound by memory bandwidth, and the schedule's job is to keep every multiprocessor
streaming until the end. One program (CTA) handles one KV head of one *split* (a contiguous run of
KV blocks of one sequence) for all ``seqlen_q * group`` query rows of that head, so each K/V tile is
read once per KV head.

The schedule is decided in two steps (``docs/design.md``, "The schedule").

1. On the host, from capacities only (:func:`plan`): the problem, the backend's tile config and
   the hardware profile's :class:`~flashdecode.hardware.Tuning` give the kernel and
   ``programs_per_head`` (P), the programs launched per KV head. Nothing here reads lengths, so a
   call never waits for the device and can be captured in a CUDA graph.

   * A backend's short-cache kernel when the keys a sequence can see fit in
     ``short_cache_max_blocks`` tiles; one program per sequence (single pass, no combine) up to
     ``split_above_blocks`` tiles, except that a backend named in ``underfilled_split_above_blocks``
     splits caches above its count into 1-block programs where B * Hk * row tiles programs would
     leave multiprocessors idle.
   * Otherwise P = B + floor(target / (Hk * row tiles)): one program per sequence plus enough extra to fill,
     without exceeding, target = multiprocessors * ``programs_per_multiprocessor``. One sequence
     splits into programs of equal work that run in whole waves of the backend's resident programs,
     so there the target is at most one wave.

2. On the device, from the real lengths (:func:`work_list` is the same rule in Python; the kernels
   evaluate it in each program). Sequence b's keys are ``[lo_b, hi_b)``: hi_b = cache_seqlens[b] +
   seqlen_new clamped to [0, capacity], lo_b = max(cache_leftpad[b], hi_b - seqlen_q -
   window_left) (window_left >= 0), clamped to [0, hi_b]. Then

   * first_b  = lo_b // block_n,  nblk_b = ceil(hi_b / block_n) - first_b  (0 when hi_b = 0)
   * chunk    = max(m, ceil(sum_b nblk_b / (P - B)))            (blocks per program, at most)
   * splits_b = max(1, ceil(nblk_b / chunk))                   (sum_b splits_b <= P)
   * program p serves the sequence b whose programs [start_b, start_b + splits_b) contain p, and
     the blocks first_b + [s * nblk_b // splits_b, (s + 1) * nblk_b // splits_b), s = p - start_b.

   m = ``min_chunk`` keeps splits long enough that a program's fixed cost and the combine stay
   small next to its streaming (``Tuning.min_blocks_per_split``; shorter where a combine merges the
   splits or a batch leaves the grid underfilled, ``min_blocks_per_combined_split``, or for one
   sequence, ``min_blocks_per_one_sequence_split``; 1 for the short caches split for idle
   multiprocessors). Since ceil(x) < x + 1, sum_b splits_b <=
   (P - B) + B = P. A forced ``num_splits = F > 0`` gives splits_b = min(F, max(1, nblk_b)) and
   P = B * min(F, max(1, the longest key span's blocks)).
"""
from __future__ import annotations

import dataclasses
import math

from .hardware import HardwareProfile
from .problem import Problem  # noqa: F401 - the planner's input, re-exported for its users

#: The kernels a plan can name. SHORT_CACHE: one program per (sequence, KV head) that loads each of
#: a few tiles directly, no pipeline; SINGLE_PASS: the split kernel with one program per sequence,
#: no combine; SPLIT: the split kernel over the balanced rule, then the combine of split sequences.
SHORT_CACHE, SINGLE_PASS, SPLIT = "short_cache", "single_pass", "split"
KERNELS = (SHORT_CACHE, SINGLE_PASS, SPLIT)
#: CUDA's largest grid y and z: the split kernel's row tiles (z) and the combine's (KV head, row)
#: pairs (y) must fit, so a call with more rows than the combine's grid holds runs unsplit.
GRID_YZ_LIMIT = 65535


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs for one call: the kernel, its tile config, and the grid of the split rule."""

    kernel: str  # SHORT_CACHE | SINGLE_PASS | SPLIT
    config: object  # the backend's frozen tile config for that kernel (has ``block_n``, ``block_m``)
    programs_per_head: int  # P: the grid is (P, nheads_k, row tiles)
    forced_splits: int = 0  # 0: the balanced rule; F > 0: every sequence split F ways
    min_chunk: int = 1  # fewest blocks per split under the balanced rule
    #: SPLIT only: the last split program of each (sequence, KV head, row tile) to finish merges the
    #: partials (one launch, no combine kernel; ``docs/design.md``, "The schedule")
    merge_in_split: bool = False
    #: SPLIT with a combine only: the combine is a programmatic dependent launch (scheduled while the
    #: split kernel drains; it waits in the kernel for the partials)
    dependent_combine: bool = False

    @property
    def block_n(self) -> int:
        return self.config.block_n

    @property
    def can_split(self) -> bool:
        return self.kernel == SPLIT

    @property
    def needs_combine(self) -> bool:
        return self.kernel == SPLIT and not self.merge_in_split

    def max_splits(self, problem: Problem) -> int:
        """Most splits one sequence can get from the device-side rule: F when forced, else at most
        P - B (chunk >= sum_b nblk_b / (P - B)) and at most ceil(max blocks / min_chunk). The keys
        one sequence sees span at most ceil((span - 1) / block_n) + 1 blocks wherever they start (a
        left window's may start mid-block), and never more than the capacity holds."""
        if self.forced_splits > 0:
            return self.forced_splits
        if not self.can_split:
            return 1
        most = self._max_blocks(problem)
        return max(1, min(self.programs_per_head - problem.batch, math.ceil(most / self.min_chunk)))

    def _max_blocks(self, problem: Problem) -> int:
        """Most KV blocks one sequence's visible keys span (see ``max_splits``)."""
        block_n = self.block_n
        return min(math.ceil(problem.seqlen_cache / block_n), (problem.key_span() + block_n - 2) // block_n + 1)

    def _chunk_at_capacity(self, problem: Problem) -> int:
        """The balanced rule's chunk with every sequence at capacity: max(m, ceil(B * max blocks / (P - B)))."""
        spare = max(1, self.programs_per_head - problem.batch)
        return max(self.min_chunk, -(-problem.batch * self._max_blocks(problem) // spare))

    def min_chunk_binds(self, problem: Problem) -> bool:
        """Whether the balanced rule's chunk is ``min_chunk`` even with every sequence at capacity,
        i.e. the keys do not fill the grid (a forced split count has no chunk)."""
        return self.can_split and self.forced_splits == 0 and self._chunk_at_capacity(problem) == self.min_chunk

    def working_programs(self, problem: Problem) -> int:
        """Most programs per KV head and row tile that get keys: one per sequence unsplit; split,
        at most P and at most B * ``max_splits`` (the lengths decide on the device)."""
        if not self.can_split:
            return problem.batch
        return min(self.programs_per_head, problem.batch * self.max_splits(problem))

    def working_grid(self, problem: Problem) -> int:
        """Most programs of the whole grid that get keys: ``working_programs`` per KV head and row tile."""
        return self.working_programs(problem) * problem.nheads_k * self.row_tiles(problem)

    def most_blocks_per_program(self, problem: Problem) -> int:
        """Most KV blocks one program streams: a whole sequence's unsplit; split, at most the device
        rule's chunk, max(m, ceil(sum_b nblk_b / (P - B))) <= max(m, ceil(B * max blocks / (P - B))),
        or a forced split's ceil(max blocks / F)."""
        most = self._max_blocks(problem)
        if not self.can_split:
            return most
        if self.forced_splits > 0:
            return -(-most // self.forced_splits)
        return min(most, self._chunk_at_capacity(problem))

    def ticket_count(self, problem: Problem) -> int:
        """Counters a merging split kernel takes tickets from: one per (sequence, KV head, row tile)."""
        return problem.batch * problem.nheads_k * self.row_tiles(problem) if self.merge_in_split else 0

    def row_tiles(self, problem: Problem) -> int:
        """Programs that share one KV head's rows: ceil(seqlen_q * group / block_m)."""
        return -(-problem.q_rows // self.config.block_m)

    def grid(self, problem: Problem) -> tuple[int, int, int]:
        return (self.programs_per_head, problem.nheads_k, self.row_tiles(problem))

    @property
    def workspace_rows(self) -> int:
        """Rows of partial results the split kernel may write (one per program and KV head)."""
        return self.programs_per_head if self.kernel == SPLIT else 0


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


def plan(problem: Problem, profile: HardwareProfile, backend, num_splits: int = 0, config=None) -> Plan:
    """Decide what runs from capacities only (see the module docstring for the rule).

    ``backend`` answers the capability questions (``flashdecode.kernels.Backend``): which kernels it
    has, its default tile config for each, and how many split programs one SM holds. ``config``
    replaces the tile config of the kernel chosen where it is of that kernel's config type (sweeps);
    ``num_splits`` > 0 forces the split; a backend without a split kernel (the reference) gets one pass
    a sequence. For a backend that launches the grid (``Backend.launches_grid``), a plan whose combine
    grid would exceed ``GRID_YZ_LIMIT`` (KV heads x query rows: a long chunk of queries) runs unsplit,
    and more row tiles than a grid holds raise ValueError naming q (max_seqlen_q for ragged queries)."""
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0, got {num_splits}")
    chosen = _plan(problem, profile, backend, num_splits, config)
    if not backend.launches_grid:
        return chosen
    if chosen.needs_combine and problem.nheads_k * problem.q_rows > GRID_YZ_LIMIT:
        chosen = _plan(problem, profile, backend, 1, config)
    tiles = chosen.row_tiles(problem)
    if tiles > GRID_YZ_LIMIT:
        name, fix = (("max_seqlen_q", "pass a tighter bound") if problem.ragged
                     else ("q", "split the queries over calls"))
        raise ValueError(f"{name}: {problem.q_rows} query rows a KV head (seqlen_q {problem.seqlen_q} x group "
                         f"{problem.nheads // problem.nheads_k}) make {tiles} row tiles of {chosen.config.block_m}, "
                         f"above the {GRID_YZ_LIMIT} a launch's grid holds: {fix}")
    return chosen


def _plan(problem: Problem, profile: HardwareProfile, backend, num_splits: int, config) -> Plan:
    """``plan``'s choice, before the grid's limits are applied."""
    tuning = profile.tuning

    def config_for(kernel):
        default = backend.default_config(problem, profile, kernel)
        return config if isinstance(config, type(default)) else default

    if SPLIT not in backend.kernels(problem):  # e.g. the reference, one pass a sequence: nothing to split
        return _for_grid(Plan(SINGLE_PASS, config_for(SINGLE_PASS), problem.batch), problem, profile, backend, config)
    split_config = config_for(SPLIT)
    max_blocks = math.ceil(problem.key_span() / split_config.block_n)
    if num_splits > 0:
        splits = min(num_splits, max(1, max_blocks))  # no empty splits
        kernel = SPLIT if splits > 1 else SINGLE_PASS
        return _for_grid(_merge_mode(Plan(kernel, config_for(kernel), problem.batch * splits, splits), problem,
                                     profile, backend), problem, profile, backend, config)
    row_tiles = -(-problem.q_rows // split_config.block_m)
    min_chunk = tuning.min_blocks_per_split
    if max_blocks <= tuning.split_above_blocks:
        underfilled = dict(tuning.underfilled_split_above_blocks).get(backend.name)
        if (underfilled is None or max_blocks <= underfilled
                or problem.batch * problem.nheads_k * row_tiles >= profile.multiprocessors):
            short = SHORT_CACHE in backend.kernels(problem) and math.ceil(
                problem.key_span() / config_for(SHORT_CACHE).block_n) <= tuning.short_cache_max_blocks  # its own tiles
            kernel = SHORT_CACHE if short else SINGLE_PASS
            return _for_grid(Plan(kernel, config_for(kernel), problem.batch), problem, profile, backend, config)
        min_chunk = 1
    per_sm = tuning.programs_per_multiprocessor
    if problem.batch == 1:
        per_sm = min(per_sm, max(1, backend.resident_programs(problem, split_config, profile)))
    extra = max(1, profile.multiprocessors * per_sm // (problem.nheads_k * row_tiles))  # never more than the target
    return _for_grid(_merge_mode(Plan(SPLIT, split_config, problem.batch + extra, min_chunk=min_chunk), problem,
                                 profile, backend), problem, profile, backend, config)


def _for_grid(plan_: Plan, problem: Problem, profile: HardwareProfile, backend, config) -> Plan:
    """``plan_`` with the backend's tile config for its grid (``Backend.for_grid``: a pipeline depth,
    a register cap), unless the caller gave the tile config."""
    if isinstance(config, type(plan_.config)):
        return plan_
    chosen = backend.for_grid(plan_.config, problem, profile, plan_.kernel, plan_.working_grid(problem),
                              plan_.most_blocks_per_program(problem))
    return plan_ if chosen == plan_.config else dataclasses.replace(plan_, config=chosen)


def _merge_mode(plan_: Plan, problem: Problem, profile: HardwareProfile, backend) -> Plan:
    """``plan_`` with how its splits are merged: in the split kernel where the backend can and no
    sequence can get more than ``max_splits_merged_in_split`` splits, nor so many that splits times
    the row tile exceeds ``max_rows_merged_in_split`` (one program merges them, a few at a time),
    else by the combine, a dependent launch where the tuning asks and the device and the backend can.
    Splits only ever get shorter here: one sequence's to the backend's
    ``min_blocks_per_one_sequence_split`` and an underfilled batch's to its
    ``min_blocks_per_combined_split``, with the tighter ``underfilled_merge_caps`` (both before the
    merge is decided), a combine's to its ``min_blocks_per_combined_split``."""
    if plan_.kernel != SPLIT:
        return plan_
    tuning = profile.tuning
    if plan_.forced_splits == 0 and problem.batch == 1:
        one_sequence = dict(tuning.min_blocks_per_one_sequence_split).get(backend.name, plan_.min_chunk)
        plan_ = dataclasses.replace(plan_, min_chunk=min(plan_.min_chunk, one_sequence))
    combined = dict(tuning.min_blocks_per_combined_split).get(backend.name, tuning.min_blocks_per_split)
    splits_cap, rows_cap = tuning.max_splits_merged_in_split, tuning.max_rows_merged_in_split
    if (tuning.underfilled_merge_caps and problem.batch > 1 and combined < plan_.min_chunk
            and plan_.min_chunk_binds(problem)):
        plan_ = dataclasses.replace(plan_, min_chunk=combined)
        splits, rows = tuning.underfilled_merge_caps  # tighter, never looser, than the general caps
        splits_cap, rows_cap = min(splits_cap, splits), rows if rows_cap is None else min(rows_cap, rows)
    most = plan_.max_splits(problem)
    if backend.merges_in_split(problem) and most <= splits_cap and (
            rows_cap is None or most * plan_.config.block_m <= rows_cap):
        return dataclasses.replace(plan_, merge_in_split=True)
    if plan_.forced_splits == 0:
        plan_ = dataclasses.replace(plan_, min_chunk=min(plan_.min_chunk, combined))
    if tuning.dependent_combine and profile.dependent_launch and backend.launches_dependent_combine(problem):
        return dataclasses.replace(plan_, dependent_combine=True)
    return plan_


def key_range(problem: Problem, cache_seqlen: int, leftpad: int = 0, seqlen_q: int | None = None) -> tuple[int, int]:
    """(lo, hi): the keys sequence b's rows can see, as the kernels compute it from its length
    ``cache_seqlens[b]`` and ``cache_leftpad[b]`` (both clamped as the kernels clamp them);
    ``seqlen_q``: a ragged call's query rows of sequence b (it then appends as many tokens)."""
    rows = problem.seqlen_q if seqlen_q is None else seqlen_q
    new = rows if problem.ragged and problem.seqlen_new else problem.seqlen_new
    hi = min(max(cache_seqlen + new, 0), problem.seqlen_cache)
    lo = max(leftpad, 0)
    if problem.window_left >= 0:
        lo = max(lo, hi - rows - problem.window_left)
    return min(lo, hi), hi


def _blocks(plan_: Plan, lo: int, hi: int) -> tuple[int, int]:
    """(first block, number of blocks) covering keys [lo, hi)."""
    first = lo // plan_.block_n
    return first, (math.ceil(hi / plan_.block_n) - first if hi > 0 else 0)


def splits_per_sequence(plan_: Plan, lengths: list[int], starts: list[int] | None = None) -> list[int]:
    """splits_b for sequences whose keys are [starts[b], lengths[b]), exactly as the kernels compute it."""
    ranges = list(zip(starts if starts is not None else [0] * len(lengths), lengths))
    blocks = [_blocks(plan_, lo, hi)[1] for lo, hi in ranges]
    if plan_.forced_splits > 0:
        return [min(plan_.forced_splits, max(1, nb)) for nb in blocks]
    if not plan_.can_split:
        return [1] * len(ranges)
    chunk = max(plan_.min_chunk, math.ceil(sum(blocks) / (plan_.programs_per_head - len(ranges))))
    return [max(1, math.ceil(nb / chunk)) for nb in blocks]


def work_list(plan_: Plan, lengths: list[int], starts: list[int] | None = None) -> list[WorkItem]:
    """Every program's slice of KV for sequences whose keys are [starts[b], lengths[b]) (one KV head;
    all heads are alike). ``starts`` defaults to 0 (``key_range`` gives both for a problem).

    Programs not listed exit without work. This mirrors the device code and is what the planner
    tests and the profiler's tail analysis reason about.
    """
    ranges = list(zip(starts if starts is not None else [0] * len(lengths), lengths))
    items = []
    program = 0
    for sequence, ((lo, hi), splits) in enumerate(zip(ranges, splits_per_sequence(plan_, lengths, starts))):
        first, blocks = _blocks(plan_, lo, hi)
        for split in range(splits):
            start = max((first + split * blocks // splits) * plan_.block_n, lo)
            end = min((first + (split + 1) * blocks // splits) * plan_.block_n, hi)
            items.append(WorkItem(program, sequence, split, splits, start, max(start, end)))
            program += 1
    if program > plan_.programs_per_head:
        raise AssertionError(f"work list needs {program} programs, plan launches {plan_.programs_per_head}")
    return items
