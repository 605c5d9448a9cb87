"""Everything a benchmark run writes: terminal table, machine lines, JSON, CSV, plot, jsonl record.

Works on a :class:`~flashdecode.bench.results.BenchRun` without importing the runner (and Triton),
so the formats can be read, tested and reused on their own.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import sys

from . import candidates

#: Machine-line fields in order: (key, how a value is written). None is written "n/a". The parser
#: also takes the short line of the optimisation loop's spec, without CASE and the bandwidth.
MACHINE_FIELDS = (
    ("CASE", str), ("COMPILED", str), ("CORRECT", str), ("BACKEND", str),
    ("RUNTIME", "{:.4f}".format), ("REF_RUNTIME", "{:.4f}".format), ("SPEEDUP", "{:.4f}x".format),
    ("BW_GBPS", str), ("BW_FRACTION", "{:.2f}".format),
)
_PARSERS = {
    "CASE": lambda v: int(v) if v.isdigit() else v, "COMPILED": lambda v: v == "True",
    "CORRECT": lambda v: v == "True", "BACKEND": str,
    "RUNTIME": float, "REF_RUNTIME": float, "SPEEDUP": lambda v: float(v.removesuffix("x")),
    "BW_GBPS": int, "BW_FRACTION": float,
}
#: Fields the short line leaves out (None when parsed from it).
OPTIONAL_MACHINE_FIELDS = ("CASE", "BW_GBPS", "BW_FRACTION")


def _rounded(value, digits):
    return None if value is None else round(value, digits)


def machine_fields(case_run, result) -> dict:
    """The machine line of one (case, variant, backend) as a dict, rounded as it is written (ms, 4
    decimals). CASE is the number for a plain case of the 14-case matrix, else "W3" or "7/q4"."""
    return {
        "case": case_run.token, "compiled": result.compiled, "correct": result.correct,
        "backend": result.system,
        "runtime": _rounded(result.timing and result.timing.median_us / 1e3, 4),
        "ref_runtime": _rounded(case_run.baseline_us and case_run.baseline_us / 1e3, 4),
        "speedup": _rounded(result.speedup, 4),
        "bw_gbps": _rounded(result.bandwidth_gbps, None),
        "bw_fraction": _rounded(result.fraction, 2),
    }


def format_machine_line(fields: dict) -> str:
    """``CASE:10 COMPILED:True CORRECT:True BACKEND:tilelang RUNTIME:0.0623 ... BW_FRACTION:0.60``."""
    return " ".join(f"{key}:{'n/a' if fields[key.lower()] is None else write(fields[key.lower()])}"
                    for key, write in MACHINE_FIELDS)


def parse_machine_line(line: str) -> dict:
    """Inverse of :func:`format_machine_line`: lower-case keys, typed values, None for n/a; also the
    6-field line ``COMPILED CORRECT BACKEND RUNTIME REF_RUNTIME SPEEDUP`` (the others None)."""
    fields = {}
    for item in line.split():
        key, _, value = item.partition(":")
        if key not in _PARSERS:
            raise ValueError(f"unknown machine-line field {key!r} in {line!r}")
        fields[key.lower()] = None if value == "n/a" else _PARSERS[key](value)
    missing = [key for key, _ in MACHINE_FIELDS if key.lower() not in fields and key not in OPTIONAL_MACHINE_FIELDS]
    if missing:
        raise ValueError(f"machine line lacks {missing}: {line!r}")
    return {key.lower(): fields.get(key.lower()) for key, _ in MACHINE_FIELDS}


def machine_lines(run) -> list[str]:
    """One line per (case, variant, our backend) that took the call."""
    return [format_machine_line(machine_fields(case_run, result))
            for case_run in run.cases for result in case_run.results if result.kind == "ours" and not result.skipped]


def _shape(case) -> dict:
    return {"batch": case.batch, "seqlen_cache": case.seqlen_cache, "nheads_k": case.nheads_k,
            "group": case.group, "nheads": case.nheads, "headdim": case.headdim, "lengths": case.lengths}


def _timing_fields(result) -> dict:
    timing, graph, eager = result.timing, result.graph, result.eager
    return {"median_us": timing and timing.median_us, "min_us": timing and timing.min_us,
            "p80_us": timing and timing.p80_us, "runs": timing and timing.runs,
            "graph_us": graph and graph.median_us, "host_overhead_us": result.host_overhead_us,
            "host_launch_us": result.host_launch_us,
            "eager_us": eager and eager.median_us, "eager_layers": result.eager_layers}


def _result_dict(result) -> dict:
    fields = {"kind": result.kind, "compiled": result.compiled, "correct": result.correct,
              **_timing_fields(result),
              "bandwidth_gbps": result.bandwidth_gbps, "fraction_of_ceiling": result.fraction,
              "speedup": result.speedup, "rel_err": result.rel_err, "fresh_rel_err": result.fresh_rel_err,
              "row_ratio": result.row_ratio, "failed_rows": result.failed_rows, "lse_error": result.lse_error,
              "skipped": result.skipped, "error": result.error}
    if result.kind == "ours":
        fields["plan"] = result.plan
        fields["host_path"] = result.host_path
    return fields


def _finite(value):
    """JSON has no NaN/inf: write them as strings ("nan" marks a NaN output)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def run_to_dict(run) -> dict:
    """The whole run as plain data (what --json writes)."""
    return _finite({
        **run.environment,
        "settings": run.settings,
        "ceiling": dataclasses.asdict(run.ceiling),
        "systems": [{"name": s.name, "kind": s.kind, "version": s.version, "description": s.description}
                    for s in run.systems],
        "skipped": run.skipped,
        "notes": run.notes,
        "cases": [{"case": c.case.label, "matrix": c.case.matrix, "variant": c.variant.name,
                   "matrix_shape": _shape(c.case), "shape": _shape(c.shape),
                   "bytes": c.bytes, "baseline_us": c.baseline_us, "baseline_source": c.baseline_source,
                   "baseline_system": c.baseline_system,
                   "results": {r.system: _result_dict(r) for r in c.results}}
                  for c in run.cases],
    })


def write_json(run, path) -> None:
    pathlib.Path(path).write_text(json.dumps(run_to_dict(run), indent=1, allow_nan=False) + "\n")


CSV_COLUMNS = ("case", "matrix", "variant", "shape", "bytes", "system", "kind", "compiled", "correct", "median_us",
               "min_us", "p80_us", "runs", "graph_us", "host_overhead_us", "host_launch_us", "host_path", "eager_us",
               "eager_layers", "bandwidth_gbps", "fraction_of_ceiling", "speedup", "rel_err", "fresh_rel_err",
               "row_ratio", "failed_rows", "lse_error", "baseline_us", "baseline_source", "skipped", "error")


def write_csv(run, path) -> None:
    """One row per (case, variant, system)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for c in run.cases:
            for r in c.results:
                writer.writerow({"case": c.case.label, "matrix": c.case.matrix, "variant": c.variant.name,
                                 "shape": c.shape.describe(), "bytes": c.bytes,
                                 "system": r.system, "baseline_us": c.baseline_us,
                                 "baseline_source": c.baseline_source, **_result_dict(r)})


def _row_label(run, case_run) -> str:
    """A case run's name in the plot and table: the case label, with the variant when the run has several."""
    several = len({c.variant.name for c in run.cases}) > 1
    return case_run.case.label + (f" {case_run.variant.name}" if several else "")


def write_plot(run, path) -> None:
    """Achieved bandwidth per case and variant, one bar per system, the in-run ceiling as a line (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [system.name for system in run.systems]
    width = 0.8 / len(names)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.0 * len(run.cases) + 2), 4.5))
    for index, name in enumerate(names):
        xs, heights = [], []
        for position, c in enumerate(run.cases):
            result = next(r for r in c.results if r.system == name)
            xs.append(position + (index - (len(names) - 1) / 2) * width)
            heights.append(result.bandwidth_gbps or 0.0)
        axes.bar(xs, heights, width, label=name)
    axes.axhline(run.ceiling.gbps, color="black", linestyle="--", label=f"ceiling {run.ceiling.gbps:.0f} GB/s")
    labels = [_row_label(run, c) for c in run.cases]
    axes.set_xticks(range(len(run.cases)), labels, rotation=90 if any(" " in label for label in labels) else 0)
    axes.set_xlabel("case")
    axes.set_ylabel("achieved bandwidth (GB/s)")
    cpu = "" if run.environment["cuda"] else " (CPU timings, not comparable)"
    axes.set_title(f"flashdecode bench on {run.environment['device']}{cpu}", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def candidate_records(run) -> list[dict]:
    """One record per (case, variant, our backend) that took the call, for a candidates log
    (``candidates.records`` of the run's JSON form)."""
    return candidates.records(run_to_dict(run))


def append_records(run, path) -> None:
    """Append the run's records to a jsonl file (created with its folder if absent); earlier lines stay."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        for record in candidate_records(run):
            handle.write(json.dumps(record, allow_nan=False) + "\n")


def _number(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def _eager_cell(result) -> str:
    """Per-call eager-loop time and its layers: "54.20 x32"."""
    if result.eager is None:
        return "-"
    return f"{result.eager.median_us:.2f} x{result.eager_layers}"


def _correct_cell(result) -> str:
    if result.skipped:
        return "skipped"
    if result.compiled and result.rel_err is not None:
        rows = "" if result.correct or not result.failed_rows else f" {result.failed_rows} rows"
        return (f"{'ok' if result.correct else 'FAIL'} {result.rel_err:.1e}/{_number(result.fresh_rel_err, '.1e')} "
                f"row {_number(result.row_ratio, '.2f')} lse {_number(result.lse_error, '.0e')}{rows}")
    return "ERROR"


def format_table(run) -> str:
    """The terminal report: header (device, versions, ceiling, the plain torch launch, notes), one row
    per (case, variant, system), then the skipped calls and the errors."""
    env = run.environment
    lines = [f"flashdecode bench on {env['device']}, commit {env['git_commit'] or 'unknown'} "
             f"(sources {env.get('source_digest') or 'unknown'}, extension "
             f"{env.get('extension_digest') or 'unknown'}), {env['date']}"]
    lines += [f"system {s.name} [{s.version}]: {s.description}" for s in run.systems]
    lines += [f"ceiling: {run.ceiling.what}: {run.ceiling.gbps:.0f} GB/s"]
    launch = run.settings.get("torch_launch_us")
    lines += [f"host time of one plain torch launch (q.add_(0)): {_number(launch, '.1f')} us per call; its GPU "
              f"time (graph, cold L2): {_number(run.settings.get('torch_launch_gpu_us'), '.2f')} us"]
    lines += [f"skipped: {reason}" for reason in run.skipped]
    lines += [f"note: {note}" for note in run.notes]
    header = (f"{'case':>4} {'variant':<8} {'shape':<28} {'system':<17} {'median us':>10} {'min us':>10} "
              f"{'p80 us':>10} {'graph us':>9} {'host us':>8} {'launch':>6} {'eager us':>13} {'GB/s':>6} {'ceil':>5} "
              f"{'speedup':>8}  correct (rel err timed/fresh, worst row error / tolerance, lse error)")
    lines += ["", header, "-" * len(header)]
    errors, skipped, python_path = [], [], []
    for c in run.cases:
        where = f"case {c.case.label} {c.variant.name}"
        for r in c.results:
            t = r.timing
            speedup = "-" if r.speedup is None else f"{r.speedup:.3f}x"
            lines.append(
                f"{c.case.label:>4} {c.variant.name:<8} {c.shape.describe():<28} {r.system:<17} "
                f"{_number(t and t.median_us, '10.2f'):>10} {_number(t and t.min_us, '10.2f'):>10} "
                f"{_number(t and t.p80_us, '10.2f'):>10} {_number(r.graph and r.graph.median_us, '9.2f'):>9} "
                f"{_number(r.host_overhead_us, '8.1f'):>8} {_number(r.host_launch_us, '6.1f'):>6} "
                f"{_eager_cell(r):>13} {_number(r.bandwidth_gbps, '6.0f'):>6} "
                f"{_number(r.fraction, '5.0%'):>5} {speedup:>8}  {_correct_cell(r)}")
            if r.error:
                errors.append(f"{where} {r.system}: {r.error}")
            if r.skipped:
                skipped.append(f"{where} {r.system}: {r.skipped}")
            if r.host_path not in (None, "compiled"):
                python_path.append(f"{where} {r.system}: {r.host_path}")
        if c.baseline_system is None and c.baseline_us is not None:
            lines.append(f"{'':>4} {'':<8} {'':<28} {'fa2 (file)':<17} {c.baseline_us:>10.2f}   "
                         f"<- baseline: {c.baseline_source}")
    if python_path:
        lines += ["", "host us from the Python path (not the compiled host path):"] + python_path
    if skipped:
        lines += ["", "skipped (the system does not take the call):"] + skipped
    if errors:
        lines += ["", "errors:"] + errors
    return "\n".join(lines)


class Progress:
    """Progress on stderr: tqdm when it imports, else a counter."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, file=stream, unit="step", leave=False)

    def advance(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label)
            self._bar.update()
        else:
            end = "\r" if self.stream.isatty() else "\n"
            print(f"[{self.done}/{self.total}] {label}", end=end, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.stream.isatty():
            print(file=self.stream)
