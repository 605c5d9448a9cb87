"""The data a benchmark run produces, free of Triton and devices so reports and tests can use it alone."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..cases import Case
from .timing import Timing


@dataclasses.dataclass(frozen=True)
class System:
    """Something timed: one of our backends ("ours"), a peer ("peer") or the torch reference (CPU)."""

    name: str
    kind: str  # "ours" | "peer" | "reference"
    version: str
    description: str  # what is called, and how
    setup: Callable  # (q, k_cache, v_cache, seqlens) -> zero-argument call giving out


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """The in-run streaming-read bandwidth, from its median time."""

    what: str
    bytes: int
    median_us: float
    gbps: float


@dataclasses.dataclass
class Result:
    """One system on one case; a failure leaves ``error`` set and ``correct`` False."""

    system: str
    kind: str
    compiled: bool = False  # the first call returned
    correct: bool = False
    rel_err: float | None = None  # worst of the timed call and its graph replay
    fresh_rel_err: float | None = None
    timing: Timing | None = None
    graph: Timing | None = None
    host_overhead_us: float | None = None
    bandwidth_gbps: float | None = None
    fraction: float | None = None  # of the ceiling
    speedup: float | None = None  # baseline / median, only when correct
    plan: dict | None = None  # our backends: dataclasses.asdict of the planner's Plan
    error: str | None = None


@dataclasses.dataclass
class CaseRun:
    case: Case  # as in the matrix
    shape: Case  # as run (scaled down without CUDA)
    bytes: int
    baseline_us: float | None
    baseline_source: str
    baseline_system: str | None  # the system of this run that is the baseline; None: the anchor file
    results: list[Result]


@dataclasses.dataclass
class BenchRun:
    environment: dict  # device, cuda, versions, git_commit, date
    settings: dict
    ceiling: Ceiling
    systems: list[System]
    skipped: list[str]  # what was left out by default, and why
    notes: list[str]  # what a reader must know to interpret the numbers
    cases: list[CaseRun]
