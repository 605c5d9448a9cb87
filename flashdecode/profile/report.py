"""The profile report: the six dimensions as figures plus a one-line diagnosis each, JSON and Markdown.

``section`` builds one hardware profile's dimensions: from the plan alone (dimensions 1 and 2) or
with what a device run measured (all six). It reads recorded counters as well as live ones, which
is how the tests check it on a fixture of ncu's CSV.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics

from .. import planner
from ..hardware import PROFILES, HardwareProfile
from . import geometry, ncu
from .catalogue import DIMENSIONS, diagnose
from .shape import Shape

from .timeline import Activity, figures as timeline_figures

PLAN_ONLY_PROFILES = ("h200", "c500")


@dataclasses.dataclass
class Measurements:
    """What a device run gave; a missing part is None, with the reason in ``errors`` (or ncu's own)."""

    ceiling_gbps: float | None = None  # in-run streaming-read ceiling, GB/s
    call_us: float | None = None  # median of the timed call (cold L2)
    activity: list[Activity] | None = None  # the traced call's device work
    graph_us: float | None = None  # median replay of the call captured in a CUDA graph (cold L2)
    graph_activity: list[Activity] | None = None  # one traced replay's device work
    counters: ncu.NcuResult | None = None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)


def _dimension(figures: dict, source: str, unavailable: str | None = None) -> dict:
    return {"source": source, "figures": figures, "unavailable": unavailable}


def auto_backend(problem, profile: HardwareProfile) -> str:
    """The backend ``auto`` runs the problem with on a device of ``profile`` (``kernels.base.auto_choice``),
    taking each backend installed here as able to run there: only what the problem alone rules out
    (``Backend.problem_limitation``) counts; "reference" when no backend takes it."""
    from ..kernels import get_backend
    from ..kernels.base import auto_choice

    def can_take(name: str) -> bool:
        backend = get_backend(name)
        return backend.unavailable() is None and backend.problem_limitation(problem) is None

    return auto_choice(problem, profile, can_take)


def section(shape: Shape, profile: HardwareProfile, measured: Measurements | None = None,
            backend: str | None = None) -> dict:
    """One hardware profile's dimensions with their diagnoses; plan-only when ``measured`` is None.

    The plan is ``backend``'s (``planner.plan`` over that backend's capabilities; when none is
    named, the one ``auto`` runs on that profile: :func:`auto_backend`); residency comes from ncu
    when it was measured, else from the backend's own count."""
    from ..kernels import get_backend

    problem, lengths = shape.problem(), shape.lengths()
    kernels = measured.counters.kernels if measured and measured.counters else []
    main = ncu.main_kernel(kernels) if kernels else None
    planning = get_backend(backend or auto_backend(problem, profile))
    plan = planner.plan(problem, profile, planning)
    planned = planning.resident_programs(problem, plan.config, profile)
    resident = ncu.resident_programs(main) if main else None
    occupancy = geometry.occupancy(problem, plan, lengths, profile, resident or planned)
    occupancy["resident_source"] = "ncu occupancy limits" if resident else \
        f"assumed: {planning.name}'s resident_programs = {planned}"
    if resident:
        occupancy["residency_vs_plan"] = resident / planned
    dims = {"occupancy": _dimension(occupancy, "plan"),
            "tail": _dimension(geometry.tail(problem, plan, lengths, profile, resident or planned), "plan")}
    if measured is not None:
        _add_measured(dims, shape.problem_bytes(), kernels, main, measured)
    figures = {key: value for dim in dims.values() for key, value in dim["figures"].items()}
    for key, dim in dims.items():
        if dim["unavailable"]:
            dim["diagnosis"], dim["patterns"] = f"not measured: {dim['unavailable']}", []
        else:
            dim["diagnosis"], dim["patterns"] = diagnose(key, figures)
    return {"hardware": profile.name, "plan_only": measured is None, "backend": planning.name,
            "backend_source": "named" if backend else "auto",
            "plan": dataclasses.asdict(plan),
            "dimensions": {key: dict(title=title, **dims[key]) for key, title in DIMENSIONS if key in dims}}


def _add_measured(dims: dict, problem_bytes: int, kernels: list, main, measured: Measurements) -> None:
    """Dimensions 1-2's measured figures, and dimensions 3-6."""
    no_counters = (measured.counters.error if measured.counters else None) or "ncu was not run"
    ncu_us = sum(k.get("gpu__time_duration.sum") or 0.0 for k in kernels) / 1e3 if kernels else None
    trace = timeline_figures(measured.activity) if measured.activity else None
    if main:
        dims["occupancy"]["figures"].update(ncu.occupancy_figures(main))
        dims["occupancy"]["figures"]["ncu_kernels"] = [ncu.kernel_row(k) for k in kernels]
        dims["occupancy"]["source"] = "plan + ncu"
    dims["tail"]["figures"].update(_ceiling_figures(problem_bytes, measured, ncu_us, trace))
    dims["tail"]["source"] = "plan + timing"
    dims["stalls"] = _dimension(ncu.stall_figures(main), "ncu") if main else _dimension({}, "ncu", no_counters)
    dims["tensor"] = _dimension(ncu.tensor_figures(main), "ncu") if main else _dimension({}, "ncu", no_counters)
    why_no_trace = measured.errors.get("timeline", "no trace")
    if trace:
        dims["timeline"] = _dimension(trace, "torch.profiler (trace.json)")
    elif ncu_us is not None:
        dims["timeline"] = _dimension({"kernel_time_us": ncu_us, "kernel_count": len(kernels)}, f"ncu ({why_no_trace})")
    else:
        dims["timeline"] = _dimension({}, "torch.profiler", why_no_trace)
    dims["timeline"]["figures"].update(_graph_figures(measured))
    if measured.graph_activity:
        dim = dims["timeline"]
        dim["source"] = "a graph replay (graph-trace.json)" if dim["unavailable"] else \
            dim["source"] + " + a graph replay (graph-trace.json)"
        dim["unavailable"] = None  # the replay's figures stand where the call's trace is missing
    dims["memory"] = _dimension(_memory_figures(problem_bytes, measured, kernels, main),
                                "timing + ceiling" + (" + ncu" if main else ""))


def _graph_figures(measured: Measurements) -> dict:
    """The call replayed from a CUDA graph: its median, and one traced replay's kernels and gaps
    (``graph_``-prefixed timeline figures), where the call could be captured and traced."""
    figures = {"graph_us": measured.graph_us}
    if measured.graph_activity:
        figures.update({f"graph_{key}": value for key, value in timeline_figures(measured.graph_activity).items()})
    elif "graph" in measured.errors:
        figures["graph_unavailable"] = measured.errors["graph"]
    return figures


def _ceiling_figures(problem_bytes: int, measured: Measurements, ncu_us: float | None, trace: dict | None) -> dict:
    """Kernel time against the time the problem's bytes need at the in-run ceiling."""
    kernel_us, source = next(((value, source) for value, source in (
        (ncu_us, "ncu gpu__time_duration.sum, all kernels"),
        (trace and trace["kernel_time_us"], "torch.profiler trace, all kernels"),
        (measured.call_us, "timed call (CUDA events)")) if value), (None, None))
    ideal_us = problem_bytes / measured.ceiling_gbps / 1e3 if measured.ceiling_gbps else None
    return {"ideal_us": ideal_us, "kernel_us": kernel_us, "kernel_us_source": source,
            "ceiling_fraction": ideal_us / kernel_us if ideal_us and kernel_us else None}


def _memory_figures(problem_bytes: int, measured: Measurements, kernels: list, main) -> dict:
    """The timed call's bandwidth, and with counters the DRAM bytes and throughput."""
    ceiling, call_us = measured.ceiling_gbps, measured.call_us
    call_gbps = problem_bytes / call_us / 1e3 if call_us else None
    figures = {"problem_bytes": problem_bytes, "ceiling_gbps": ceiling, "call_us": call_us, "call_gbps": call_gbps,
               "call_fraction_of_ceiling": call_gbps / ceiling if call_gbps and ceiling else None}
    if main is None:
        return figures
    read = [k.get("dram__bytes_read.sum") for k in kernels]
    total = sum(read) if None not in read else None
    main_read, main_ns = main.get("dram__bytes_read.sum"), main.get("gpu__time_duration.sum")
    dram_gbps = main_read / main_ns if main_read is not None and main_ns else None  # bytes per ns = GB/s
    local = ncu.local_bytes(kernels)
    figures.update({
        "local_memory_bytes": local,
        "local_over_problem": local / problem_bytes if local is not None else None,
        "dram_read_bytes": total,
        "dram_read_bytes_main": main_read,
        "dram_write_bytes": main.get("dram__bytes_write.sum"),
        "dram_read_over_problem": total / problem_bytes if total is not None else None,
        "dram_throughput_pct": main.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        "dram_gbps": dram_gbps,
        "dram_fraction_of_ceiling": dram_gbps / ceiling if dram_gbps is not None and ceiling else None,
    })
    return figures


def plan_only(shape: Shape, backend: str | None) -> dict:
    """The report of a machine without a device: dimensions 1 and 2 for the H200 and the C500, with
    ``backend``'s plan, or (None) the plan of the backend ``auto`` runs on each."""
    sections = [section(shape, PROFILES[name], backend=backend) for name in PLAN_ONLY_PROFILES]
    which = (f"backend {backend!r} (named)" if backend else "the backend auto runs on each profile: " +
             ", ".join(f"{s['hardware']} {s['backend']}" for s in sections))
    notes = ["PLAN ONLY: no CUDA device here, so nothing was run or measured; dimensions 1 and 2 come "
             "from the planner for each hardware profile (flashdecode.hardware.PROFILES), with the plan and "
             f"residency of {which}: computed, not measured."]
    return build(shape, backend, "plan-only", sections, notes, {})


def notes_for(measured: Measurements) -> list[str]:
    """What a reader must know about a measured run: what is missing and why."""
    notes = [f"{part}: {why}" for part, why in measured.errors.items()]
    counters = measured.counters
    if counters is None or counters.error:
        notes.append(f"counters (dimensions 3, 4 and parts of 1 and 6): unavailable: "
                     f"{counters.error if counters else 'ncu was not run'}")
    elif counters.dropped:
        notes.append(f"this ncu does not know these metrics, left out: {', '.join(counters.dropped)}")
    if counters and counters.kernels:
        notes.append("counters: each kernel profiled by ncu with caches flushed and clocks not locked; "
                     "figures of dimensions 1, 3, 4 are the main (split) kernel's, medians over its launches")
    return notes


def build(shape: Shape, backend: str | None, mode: str, sections: list[dict], notes: list[str],
          extra: dict) -> dict:
    """The whole report: the shape and its lengths, notes, ``extra`` (device, files...), the sections."""
    lengths = shape.lengths()
    return {"shape": {"label": shape.label, "case": shape.case.label if shape.case.number else None,
                      **dataclasses.asdict(shape.case),
                      "nheads": shape.case.nheads, "headdim": shape.headdim, "dtype": shape.dtype},
            "describe": shape.describe(), "backend": backend, "mode": mode, "lengths": lengths,
            "problem_bytes": shape.problem_bytes(), "notes": notes, **extra, "sections": sections}


# --- writing ------------------------------------------------------------------------------------

def _format(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e3 else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_format(v)}" for k, v in value.items())
    return ", ".join(_format(v) for v in value)


def _table(rows: list[dict]) -> list[str]:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_format(row[c]) for c in columns) + " |" for row in rows]


def to_markdown(report: dict) -> str:
    lengths = report["lengths"]
    lines = [f"# flashdecode profile: {report['describe']}, backend {report['backend'] or 'any (plan)'}", "",
             f"- mode: **{report['mode']}**" + (f" on {report['device']}" if report.get("device") else ""),
             f"- lengths: {len(lengths)} sequences, {min(lengths)}..{max(lengths)} tokens "
             f"(mean {statistics.fmean(lengths):.0f})",
             f"- bytes the call must move: {report['problem_bytes']:,}"]
    lines += [f"- {note}" for note in report["notes"]]
    for section_ in report["sections"]:
        kind = "plan only" if section_["plan_only"] else "measured"
        lines += ["", f"## {section_['hardware']} ({kind}), backend {section_['backend']} "
                      f"({section_['backend_source']}): plan {_format(section_['plan'])}"]
        for dim in section_["dimensions"].values():
            lines += ["", f"### {dim['title']}", "", f"**Diagnosis:** {dim['diagnosis']}", "",
                      f"Source: {dim['source']}"]
            scalars = {k: v for k, v in dim["figures"].items()
                       if not (isinstance(v, list) and v and isinstance(v[0], dict))}
            if scalars:
                lines += ["", "| figure | value |", "|---|---|"]
                lines += [f"| {k} | {_format(v)} |" for k, v in scalars.items()]
            for key, rows in dim["figures"].items():
                if key not in scalars:
                    lines += ["", f"{key}:", "", *_table(rows)]
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """DIR/report.json and DIR/report.md; returns their paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(to_markdown(report))
    return json_path, md_path
