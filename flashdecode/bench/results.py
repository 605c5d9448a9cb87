"""The data a benchmark run produces, free of Triton and devices so reports and tests can use it alone."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..cases import Case, Variant
from .timing import Timing


@dataclasses.dataclass(frozen=True)
class System:
    """Something timed: one of our backends ("ours"), a peer ("peer") or the torch reference (CPU).

    ``check(call)`` returns what the report records about how the system takes the call (our
    backends: the planner's Plan as a dict; others: None) or raises ``Unsupported`` with the reason.
    ``setup(calls)`` does the one-time work for a list of ``cases.Call`` (the layers of one case and
    variant, same lengths) and returns one zero-argument function per call, each giving ``out``.
    ``launch_path(call)`` (our backends only): (calls the compiled host path launched so far in the
    context that takes ``call``, why that path is off there or None), so the report can say which
    path the host time measured. ``setup_with_lse(calls)`` (where the system can return lse): the
    same calls returning (out, lse), for the correctness check (``correctness``); without it a
    system is judged on out alone."""

    name: str
    kind: str  # "ours" | "peer" | "reference"
    version: str
    description: str  # what is called, and how
    check: Callable
    setup: Callable
    launch_path: Callable | None = None
    setup_with_lse: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """The in-run streaming-read bandwidth, from its median time."""

    what: str
    bytes: int
    median_us: float
    gbps: float


@dataclasses.dataclass
class Result:
    """One system on one case and variant; a failure leaves ``error`` set and ``correct`` False; a
    call the system cannot take leaves ``skipped`` set (the reason) and nothing measured."""

    system: str
    kind: str
    compiled: bool = False  # the first call returned
    #: every row of out within its tolerance and lse within its own, on the timed inputs, the graph
    #: replay and fresh inputs (``correctness``)
    correct: bool = False
    rel_err: float | None = None  # ||out - ref|| / ||ref||, worst of the timed call and its graph replay
    fresh_rel_err: float | None = None
    row_ratio: float | None = None  # worst row's error / its tolerance over the three checks (> 1: wrong)
    failed_rows: int | None = None  # rows over their tolerance, in the worst check
    lse_error: float | None = None  # worst |lse - ref| over the three checks; None: no lse returned
    timing: Timing | None = None  # cold L2, one call per event pair
    graph: Timing | None = None  # replayed from a CUDA graph: GPU time
    host_overhead_us: float | None = None  # host time per call
    #: host time per call of one plain torch launch, in loops alternating with those of host_overhead_us
    host_launch_us: float | None = None
    #: our backends: "compiled" when every call of the host-time loop launched from the compiled host
    #: path's records, else "python: " and why not
    host_path: str | None = None
    eager: Timing | None = None  # per call of a loop over eager_layers layers
    eager_layers: int | None = None
    bandwidth_gbps: float | None = None
    fraction: float | None = None  # of the ceiling
    speedup: float | None = None  # baseline / median, only when correct
    plan: dict | None = None  # our backends: dataclasses.asdict of the planner's Plan
    skipped: str | None = None
    error: str | None = None


@dataclasses.dataclass
class CaseRun:
    case: Case  # as in the matrix
    shape: Case  # as run (scaled down without CUDA)
    variant: Variant
    bytes: int
    baseline_us: float | None
    baseline_source: str
    baseline_system: str | None  # the system of this run that is the baseline; None: the anchor file or none
    results: list[Result]

    @property
    def token(self) -> str | int:
        """The case as machine lines and records name it: the number for a plain case of the
        14-case matrix (the machine-line spec), else "label" or "label/variant" ("W3", "7/q4")."""
        if self.case.matrix == "cases" and self.variant.name == "plain":
            return self.case.number
        return self.case.label + ("" if self.variant.name == "plain" else f"/{self.variant.name}")


@dataclasses.dataclass
class BenchRun:
    environment: dict  # device, cuda, versions, git_commit, date
    settings: dict
    ceiling: Ceiling
    systems: list[System]
    skipped: list[str]  # what was left out by default, and why
    notes: list[str]  # what a reader must know to interpret the numbers
    cases: list[CaseRun]
