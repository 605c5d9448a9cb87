"""Dimension 5: the kernels of one call and the gaps between them, from a torch.profiler trace.

``capture`` runs the call a few times under torch.profiler (CUDA activity), each run after the
same L2 flush as the benchmark's Timer and inside a ``record_function`` range that ends with a
device sync, and writes the Chrome trace. ``last_call`` reads the device activity (kernels,
memsets, copies) whose start lies inside the last range; ``figures`` turns it into durations and gaps.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

from .ncu import kernel_role

CALL_RANGE = "flashdecode.profile.call"
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
TRACE_CALLS = 3  # the first ones absorb the profiler's own start-up


@dataclasses.dataclass(frozen=True)
class Activity:
    """One piece of device work of the call; ``start_us`` counts from the call's first one."""

    name: str
    category: str
    start_us: float
    duration_us: float


def capture(call, flush_bytes: int, trace_path: pathlib.Path) -> list[Activity]:
    """Trace ``TRACE_CALLS`` calls (``flush_bytes`` zeroed before each, as Timer does), write the
    Chrome trace to ``trace_path`` and return the last call's device activity."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") if flush_bytes else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(TRACE_CALLS):
            if flush is not None:
                flush.zero_()
            torch.cuda.synchronize()
            with record_function(CALL_RANGE):
                call()
                torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace_path))
    return last_call(json.loads(pathlib.Path(trace_path).read_text()))


def last_call(trace: dict) -> list[Activity]:
    """Device activity starting inside the last ``CALL_RANGE`` range of a Chrome trace, in order."""
    events = trace.get("traceEvents", [])
    ranges = [e for e in events if e.get("name") == CALL_RANGE and e.get("cat") == "user_annotation"]
    if not ranges:
        return []
    last = max(ranges, key=lambda e: float(e["ts"]))
    begin, end = float(last["ts"]), float(last["ts"]) + float(last.get("dur", 0.0))
    inside = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"
                     and begin <= float(e["ts"]) <= end), key=lambda e: float(e["ts"]))
    if not inside:
        return []
    origin = float(inside[0]["ts"])
    return [Activity(e["name"], e["cat"], float(e["ts"]) - origin, float(e.get("dur", 0.0))) for e in inside]


def figures(activity: list[Activity]) -> dict:
    """Durations, gaps and their share of the call's span on the device."""
    span = max(a.start_us + a.duration_us for a in activity)
    busy_until, gaps = 0.0, 0.0
    for a in activity:
        gaps += max(0.0, a.start_us - busy_until)
        busy_until = max(busy_until, a.start_us + a.duration_us)
    kernels = [a for a in activity if a.category == "kernel"]
    return {
        "device_activity": [dataclasses.asdict(a) for a in activity],
        "kernel_count": len(kernels),
        "extra_activity": [a.name for a in activity if a.category != "kernel" or kernel_role(a.name) == "other"],
        "kernel_time_us": sum(a.duration_us for a in kernels),
        "call_span_us": span,
        "gap_us": gaps,
        "gap_share": gaps / span if span else 0.0,
    }
