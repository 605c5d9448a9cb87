"""The six dimensions of a profile and the catalogue of diagnosis patterns A-M, as data (the one place).

A pattern fires when its conditions hold on the figures of a profile (all of them, or any of
them with ``any_of``); each condition compares one named figure with a threshold. Each names the
pattern-library entries (docs/patterns/) its remedy draws on and what to read on the C500.
docs/diagnosis.md explains every pattern (trigger, metric, threshold, remedy) and a test keeps it
in step.
"""
from __future__ import annotations

import dataclasses

#: (key, title) of each dimension, in report order.
DIMENSIONS = (
    ("occupancy", "1. Occupancy and launch geometry"),
    ("tail", "2. Tail effect"),
    ("stalls", "3. Stall breakdown"),
    ("tensor", "4. Tensor core utilisation"),
    ("timeline", "5. Timeline"),
    ("memory", "6. Memory bandwidth"),
)


@dataclasses.dataclass(frozen=True)
class Condition:
    figure: str
    op: str  # "<" or ">"
    threshold: float

    def holds(self, figures: dict) -> bool | None:
        """None when the figure is missing (not measured here)."""
        value = figures.get(self.figure)
        if value is None:
            return None
        return value < self.threshold if self.op == "<" else value > self.threshold

    def evidence(self, figures: dict) -> str:
        """The figure against the threshold, with the digits that tell them apart (1.5028 > 1.5)."""
        value = figures[self.figure]
        shown = next((f"{value:.{digits}g}" for digits in (3, 4, 5, 6)
                      if f"{value:.{digits}g}" != f"{self.threshold:.{digits}g}"), repr(value))
        return f"{self.figure} {shown} {self.op} {self.threshold:g}"

    def __str__(self) -> str:
        return f"{self.figure} {self.op} {self.threshold:g}"


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One lettered diagnosis: the figures that trigger it, its remedy and where the pattern library
    (docs/patterns/) describes the techniques it points to."""

    letter: str  # A-M: the checklist's order
    key: str
    dimension: str
    title: str
    conditions: tuple[Condition, ...]
    fix: str  # one line; docs/diagnosis.md has the longer story
    library: tuple[str, ...]  # entries of docs/patterns/, "file.md#anchor"
    c500: str  # what to read on the C500 (mcProfiler / mcTracer), see docs/diagnosis.md
    any_of: bool = False  # False: every condition must hold
    note: bool = False  # expected behaviour worth stating, not a problem

    def triggered(self, figures: dict) -> bool | None:
        """True/False, or None when a missing figure leaves the answer open."""
        results = [condition.holds(figures) for condition in self.conditions]
        decisive = True if self.any_of else False
        if decisive in results:
            return decisive
        return None if None in results else not decisive

    def line(self, figures: dict) -> str:
        held = [c.evidence(figures) for c in self.conditions if c.holds(figures)]
        kind = "note" if self.note else "fix"
        return f"{self.letter}. {self.title} ({', '.join(held)}); {kind}: {self.fix}"


PATTERNS: tuple[Pattern, ...] = (
    Pattern("A", "small_grid", "occupancy", "small grid", (Condition("programs_per_sm", "<", 1.0),),
            "split the KV further so every multiprocessor gets a program (planner's split rule)",
            ("l2-algorithm.md#split-kv-schedule", "l1-graph.md#split-kv-subgraph"),
            "APs with no wave in mcTracer's timeline; programs with work / 104 APs"),
    Pattern("B", "residency_below_plan", "occupancy", "fewer resident programs than planned",
            (Condition("residency_vs_plan", "<", 1.0),),
            "cut registers or shared memory per program (stages, block_n), or plan for the residency measured",
            ("l3-kernel.md#shared-memory-budget", "l3-kernel.md#registers-and-threads"),
            "mcProfiler's occupancy limiter (registers, LDS, waves) against the plan's resident programs"),
    Pattern("C", "low_achieved_occupancy", "occupancy", "warps resident far below the limit",
            (Condition("achieved_over_theoretical", "<", 0.5),),
            "more programs or longer ones per slot: finer splits, persistent programs that take the next item",
            ("paradigms.md#persistent-kernel", "paradigms.md#work-stealing"),
            "achieved against theoretical waves per AP (mcProfiler occupancy)"),
    Pattern("D", "wave_tail", "tail", "wave tail", (Condition("last_wave_idle_fraction", ">", 0.25),),
            "size the grid to a whole number of waves of resident programs",
            ("l2-algorithm.md#split-kv-schedule", "paradigms.md#persistent-kernel"),
            "the plan's figure (same model with 104 APs); mcTracer's last wave"),
    Pattern("E", "work_imbalance", "tail", "unbalanced work", (Condition("max_over_mean_work", ">", 1.5),),
            "balance splits across sequences (smaller chunks for long ones, a smaller block_n)",
            ("l2-algorithm.md#split-kv-schedule", "paradigms.md#work-stealing"),
            "the plan's figure; per-wave durations in mcTracer"),
    Pattern("F", "below_ceiling", "tail", "far below the bandwidth ceiling",
            (Condition("ceiling_fraction", "<", 0.6),),
            "the kernel takes much longer than its bytes need: read the other patterns to see why",
            ("filters.md#memory-bound", "filters.md#latency-bound"),
            "kernel time (mcTracer) against the bytes over the in-run ceiling"),
    Pattern("G", "latency_bound", "stalls", "latency-bound",
            (Condition("long_scoreboard_share", ">", 0.4), Condition("dram_fraction_of_ceiling", "<", 0.7)),
            "keep more bytes in flight: deeper pipeline, larger tiles, TMA/cp.async, more resident warps",
            ("filters.md#latency-bound", "l3-kernel.md#tiling", "paradigms.md#warp-specialisation"),
            "stalls waiting on global loads against HBM throughput (mcProfiler)"),
    Pattern("H", "barrier_bound", "stalls", "barrier-bound", (Condition("barrier_share", ">", 0.3),),
            "fewer block-wide barriers per tile: warp specialisation, more stages, mbarrier waits",
            ("l3-kernel.md#synchronisation", "paradigms.md#warp-specialisation"),
            "cycles waiting at barriers (mcProfiler); MACA has no partial (named) barriers"),
    Pattern("I", "bank_conflicts", "stalls", "shared-memory bank conflicts",
            (Condition("bank_conflict_ratio", ">", 0.1),),
            "swizzle or pad the shared-memory layout of the K/V tiles",
            ("l3-kernel.md#bank-padding",),
            "LDS bank conflict cycles against LDS accesses (32 banks per AP)"),
    Pattern("J", "register_spills", "memory", "register spills",
            (Condition("local_over_problem", ">", 0.01),),
            "fewer live values per thread: smaller row tiles, fewer stages held in registers, a register cap "
            "that does not spill",
            ("l3-kernel.md#registers-and-threads",),
            "scratch (private memory) traffic reported by mcProfiler"),
    Pattern("K", "low_tensor_use", "tensor", "low tensor-core use", (Condition("tensor_active_pct", "<", 10.0),),
            "expected for decode (G query rows per K/V tile: a few flops per byte); not a problem",
            ("l0-math.md#gqa-arithmetic-intensity",),
            "MMA pipe activity (mcProfiler)", note=True),
    Pattern("L", "launch_bound", "timeline", "launch-bound",
            (Condition("kernel_time_us", "<", 10.0), Condition("gap_share", ">", 0.2)),
            "replay in a CUDA graph, skip the combine pass when nothing split, drop extra fills (graph_gap_us: "
            "what a replay still leaves between the kernels)", any_of=True,
            library=("l1-graph.md#split-kv-subgraph", "l2-algorithm.md#schedule-materialisation"),
            c500="kernel durations and the gaps between them in mcTracer"),
    Pattern("M", "extra_dram_traffic", "memory", "extra DRAM traffic",
            (Condition("dram_read_over_problem", ">", 1.1),),
            "read each K/V tile once per KV head (whole GQA group per program); keep partials small",
            ("l2-algorithm.md#gqa-group-dispatch", "l1-graph.md#qk-softmax-pv-fusion"),
            "HBM bytes read (mcProfiler) against the call's bytes"),
)

#: The patterns by letter.
BY_LETTER = {pattern.letter: pattern for pattern in PATTERNS}


def diagnose(dimension: str, figures: dict) -> tuple[str, list[str]]:
    """(one-line diagnosis, keys of the patterns that fired) for one dimension, from all figures."""
    fired, open_ = [], []
    for pattern in PATTERNS:
        if pattern.dimension != dimension:
            continue
        result = pattern.triggered(figures)
        if result:
            fired.append(pattern)
        elif result is None:
            open_.append(pattern.key)
    if fired:
        return "; ".join(p.line(figures) for p in fired), [p.key for p in fired]
    line = "no pattern of the catalogue fires"
    if open_:
        line += f" (not evaluated for lack of figures: {', '.join(open_)})"
    return line, []
