"""Everything a benchmark run writes: terminal table, machine lines, JSON, CSV, plot, jsonl record,
and the markdown page of a run (``docs/benchmarks.md``).

Works on a :class:`~flashdecode.bench.results.BenchRun` without importing the runner (and Triton),
so the formats can be read, tested and reused on their own. The markdown page is computed from the
run as ``--json`` writes it, so an existing JSON regenerates it:
``python -m flashdecode.bench.report docs/benchmarks.json > docs/benchmarks.md``.
"""
from __future__ import annotations

import argparse
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
    """The run as JSON at ``path`` (:func:`write_run_dict`)."""
    write_run_dict(run_to_dict(run), path)


def write_run_dict(data: dict, path) -> None:
    """A run's plain data as JSON at ``path``, written beside it and then renamed over it, so a
    process killed while writing (a time limit during ``bench``'s writes after each case) leaves the
    last whole run."""
    path = pathlib.Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    partial.replace(path)


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


# --- the markdown page of a run (docs/benchmarks.md) ----------------------------------------------

#: Where a cell of the markdown page lacks a value (the system skipped the call, failed or was not timed).
MISSING = "-"
#: Host time per call over the plain torch launch timed beside it above which the page names the case.
HOST_RATIO_LIMIT = 1.5
#: Fractions of the in-run ceiling at which the page states the headroom over FA2.
HEADROOM_FRACTIONS = (1.0, 0.9)


def _value(result, key):
    """A timing of a result dict as a float, None where absent or not a finite number."""
    value = (result or {}).get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _us(value) -> str:
    """Microseconds with two decimals below 10 us, one above."""
    return MISSING if value is None else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _timed(result) -> bool:
    """Whether a result dict holds a correct, timed call."""
    return bool(result and result.get("correct") and _value(result, "median_us") is not None)


def _our_systems(run) -> list[str]:
    return [system["name"] for system in run["systems"] if system["kind"] == "ours"]


def _case_name(case) -> str:
    return case["case"] + ("" if case["variant"] == "plain" else f" {case['variant']}")


def _fastest(case, names, key):
    """(name, time) of the correct system among ``names`` with the lowest ``key`` time, or (None, None)."""
    times = [(name, _value(case["results"].get(name), key)) for name in names if _timed(case["results"].get(name))]
    return min(((name, time) for name, time in times if time is not None), key=lambda item: item[1],
               default=(None, None))


def _baseline(case, key):
    """The baseline's time of a case: the cold median the run recorded (``baseline_us``, also from the
    anchor file) or, for GPU (graph) time, the baseline system's in this run; None where absent."""
    if key == "median_us":
        return _value(case, "baseline_us")
    result = case["results"].get(case.get("baseline_system") or "")
    return _value(result, key) if _timed(result) else None


#: How the shape cell names each length rule of ``cases.case_seqlens`` (batches of one are always full).
LENGTHS = {"matrix": "lengths S/4..S", "equal": "full", "uniform": "lengths 1..S", "skewed": "skewed lengths"}


def _shape_cell(shape) -> str:
    full = shape["batch"] == 1 or shape["lengths"] == "equal"
    return (f"{shape['batch']}, {shape['seqlen_cache']}, {shape['nheads_k']}, {shape['group']}, {shape['headdim']}"
            + ("" if full else f" ({LENGTHS.get(shape['lengths'], shape['lengths'])})"))


def _timings_cell(result) -> str:
    """"median / GPU / host / eager" of a result dict."""
    if not result or result.get("skipped"):
        return "skipped" if result else MISSING
    if not _timed(result):
        return "FAIL" if result.get("compiled") else "ERROR"
    return " / ".join(_us(_value(result, key)) for key in ("median_us", "graph_us", "host_overhead_us", "eager_us"))


def speedups(run) -> dict:
    """{(variant, measure, who): [baseline time / ours per case]}: measure "cold median" or "GPU time",
    who one of our systems or "best" (the faster of ours on that measure), over the cases where the
    baseline and ours have a time."""
    ours, table = _our_systems(run), {}
    for case in run["cases"]:
        for measure, key in (("cold median", "median_us"), ("GPU time", "graph_us")):
            baseline = _baseline(case, key)
            if baseline is None:
                continue
            candidates = [(name, _value(case["results"][name], key)) for name in ours
                          if _timed(case["results"].get(name))]
            candidates += [("best", _fastest(case, ours, key)[1])]
            for who, time in candidates:
                if time is not None:
                    table.setdefault((case["variant"], measure, who), []).append(baseline / time)
    return table


def host_ratios(run) -> dict:
    """{our system: [(case name, host time per call / the torch launch timed beside it)]}."""
    ratios = {}
    for name in _our_systems(run):
        for case in run["cases"]:
            result = case["results"].get(name)
            host, launch = _value(result, "host_overhead_us"), _value(result, "host_launch_us")
            if host is not None and launch:
                ratios.setdefault(name, []).append((_case_name(case), host / launch))
    return ratios


def headroom(run, fractions=HEADROOM_FRACTIONS) -> dict:
    """{fraction: geometric mean over FA2's GPU (graph) time} that a system would reach with every plain
    case reading its bytes at ``fraction`` of the in-run ceiling and none below the GPU time of one
    plain torch launch (``torch_launch_gpu_us``, the floor of a one-kernel call), over the plain cases
    FA2 ran correctly in the run; {} where the run lacks FA2 or that floor. Nothing reads at the
    ceiling, so the value at 1.0 bounds every system's geometric mean over FA2 in that run."""
    floor, bytes_per_us = run["settings"].get("torch_launch_gpu_us"), run["ceiling"]["gbps"] * 1e3
    fa2 = [(case["bytes"], _value(case["results"]["fa2"], "graph_us")) for case in run["cases"]
           if case["variant"] == "plain" and _timed(case["results"].get("fa2"))
           and _value(case["results"]["fa2"], "graph_us")]
    if floor is None or not fa2:
        return {}
    return {fraction: geomean([graph / max(size / (fraction * bytes_per_us), floor) for size, graph in fa2])
            for fraction in fractions}


def _against_plain(run) -> list[str]:
    """Each variant's fastest GPU time of ours over the plain call's, per case (where the run has both)."""
    ours = _our_systems(run)
    plain = {case["case"]: _fastest(case, ours, "graph_us")[1] for case in run["cases"] if case["variant"] == "plain"}
    variants = list(dict.fromkeys(case["variant"] for case in run["cases"] if case["variant"] != "plain"))
    rows = {}
    for case in run["cases"]:
        graph = _fastest(case, ours, "graph_us")[1]
        if case["variant"] != "plain" and plain.get(case["case"]) and graph is not None:
            rows.setdefault(case["case"], {})[case["variant"]] = f"{graph / plain[case['case']]:.2f}"
    if not rows:
        return []
    return ["", "### Variants against the plain call", "",
            "The fastest GPU time of our backends on each variant over that on the plain call of the same case:",
            "", "| case | plain µs | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)] + [
        f"| {label} | {_us(plain[label])} | " + " | ".join(row.get(name, MISSING) for name in variants) + " |"
        for label, row in rows.items()]


def _provenance(run) -> list[str]:
    settings, ceiling = run["settings"], run["ceiling"]
    commit = run.get("git_commit") or "unknown"
    peers = {system["name"] for system in run["systems"] if system["kind"] == "peer"}
    versions = ", ".join(f"{name} {version}" for name, version in run["versions"].items()
                         if version is not None and name not in peers)  # the peers' are in the systems' table
    lines = ["## The run", "",
             f"- Device: {run['device']}; date (UTC): {run['date']}.",
             f"- Code: commit `{commit}`, sources digest `{run.get('source_digest') or 'unknown'}`, extension digest "
             f"`{run.get('extension_digest') or 'unknown'}` (`flashdecode.bench.provenance`: the digests name the "
             "code that ran where git's view of the checkout was stale).",
             f"- Versions: {versions}.",
             f"- Timing: {settings.get('iters')} timed runs after {settings.get('warmup')} warm-up runs, median; "
             + (f"L2 flushed ({settings['flush_bytes'] / 2 ** 20:.0f} MiB written) before every run"
                if settings.get("cold_l2") else "L2 not flushed") + f"; {settings.get('dtype', 'bfloat16')}.",
             f"- Ceiling: {ceiling['what']}: {ceiling['gbps']:.0f} GB/s.",
             f"- One plain torch launch (`q.add_(0)`): {_us(settings.get('torch_launch_us'))} µs of host time per call, "
             f"{_us(settings.get('torch_launch_gpu_us'))} µs of GPU time (graph, cold L2): the floor of a one-kernel "
             "call's GPU time."]
    lines += [f"- Note: {note}" for note in run["notes"]]
    lines += [f"- Left out: {reason}" for reason in run["skipped"]]
    lines += ["", "| system | version | what is timed |", "|---|---|---|"]
    lines += [f"| {s['name']} ({s['kind']}) | {s['version']} | {s['description']} |" for s in run["systems"]]
    return lines


def _results(run) -> list[str]:
    ours = _our_systems(run)
    head = ["FA2" if name == "fa2" else name for name in (["fa2"] if _has(run, "fa2") else []) + ours]
    lines = ["", "## Results", "",
             "Times in µs: cold median / GPU time (the call replayed from a CUDA graph) / host time per call / "
             "eager loop per call. \"best ×FA2\": the baseline over the faster of our backends, on cold medians "
             "and on GPU time. \"of ceiling\": the faster backend's bytes per second over the in-run ceiling.", "",
             "| case | batch, seqlen_cache, Hk, G, D | MB read | " + " | ".join(head)
             + " | kernels (" + ", ".join(ours) + ") | best ×FA2 (median / GPU) | of ceiling |",
             "|---|---|---|" + "---|" * (len(head) + 3)]
    for case in run["cases"]:
        results = case["results"]
        cells = [_timings_cell(results.get("fa2"))] if _has(run, "fa2") else []
        if "fa2" not in results and _has(run, "fa2") and case.get("baseline_us") is not None:
            cells = [f"{_us(case['baseline_us'])} (file)"]
        cells += [_timings_cell(results.get(name)) for name in ours]
        kernels = ", ".join(((results.get(name) or {}).get("plan") or {}).get("kernel", MISSING) for name in ours)
        ratios = []
        for key in ("median_us", "graph_us"):
            baseline, best = _baseline(case, key), _fastest(case, ours, key)
            ratios.append(MISSING if baseline is None or best[1] is None else f"{baseline / best[1]:.2f}× ({best[0]})")
        name, median = _fastest(case, ours, "median_us")
        fraction = MISSING if name is None or not _value(results[name], "fraction_of_ceiling") else \
            f"{results[name]['fraction_of_ceiling']:.2f}"
        lines.append(f"| {_case_name(case)} | {_shape_cell(case['shape'])} | {case['bytes'] / 1e6:.3g} | "
                     + " | ".join(cells) + f" | {kernels} | {' / '.join(ratios)} | {fraction} |")
    return lines


def _has(run, name) -> bool:
    return any(system["name"] == name for system in run["systems"])


def _every_system(run) -> list[str]:
    names = [system["name"] for system in run["systems"]]
    lines = ["", "## Every system", "", "Cold median / GPU time in µs, every system of the run:", "",
             "| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for case in run["cases"]:
        cells = []
        for name in names:
            result = case["results"].get(name)
            cells.append(" / ".join(_us(_value(result, key)) for key in ("median_us", "graph_us")) if _timed(result)
                         else _timings_cell(result))
        lines.append(f"| {_case_name(case)} | " + " | ".join(cells) + " |")
    return lines


def _summary(run) -> list[str]:
    sources = ", ".join(dict.fromkeys(case["baseline_source"] for case in run["cases"]))
    lines = ["", "## Summary", "", f"Baseline: {sources}.", ""]
    for (variant, measure, who), values in speedups(run).items():
        whom = "the faster of our backends" if who == "best" else who
        lines.append(f"- {variant}, {measure}: {whom} faster than the baseline on {sum(v > 1 for v in values)} "
                     f"of {len(values)} cases, geometric mean {geomean(values):.2f}×.")
    for name, ratios in host_ratios(run).items():
        above = [f"{label} ({ratio:.2f}×)" for label, ratio in ratios if ratio > HOST_RATIO_LIMIT]
        lines.append(f"- {name}: host time per call over the torch launch timed beside it "
                     f"{min(r for _, r in ratios):.2f}-{max(r for _, r in ratios):.2f}×; above {HOST_RATIO_LIMIT}×: "
                     f"{', '.join(above) or 'none'}.")
    bounds = headroom(run)
    if bounds:
        lines.append("- Headroom: with every plain case at " + ", ".join(
            f"{fraction:.0%} of the ceiling a system would reach {value:.2f}×" for fraction, value in bounds.items())
            + f" FA2's GPU time (geometric mean; no case below one torch launch's "
              f"{_us(run['settings']['torch_launch_gpu_us'])} µs).")
    return lines + _against_plain(run)


def _correctness(run) -> list[str]:
    # Runs before the per-row bound (2026-12-03's among them) recorded one relative-error threshold.
    threshold = run["settings"].get("rel_err_threshold")
    criterion = "the bound the notes give" if threshold is None else f"relative L2 error at most {threshold}"
    timed = [(case, name, result) for case in run["cases"] for name, result in case["results"].items()
             if not result.get("skipped")]
    wrong = [f"{_case_name(case)} {name}: {result.get('error') or 'relative error ' + str(result.get('rel_err'))}"
             for case, name, result in timed if not result.get("correct")]
    skipped = {}  # (system, reason) -> the cases
    for case in run["cases"]:
        for name, result in case["results"].items():
            if result.get("skipped"):
                skipped.setdefault((name, result["skipped"]), []).append(_case_name(case))
    lines = ["", "## Correctness", "",
             f"Every result is checked in the run against `flashdecode.reference` ({criterion}) on the timed "
             "inputs, the graph replay and fresh inputs. "
             + (f"All {len(timed)} timed results passed." if not wrong else
                f"{len(timed) - len(wrong)} of {len(timed)} timed results passed; failed:")]
    lines += [f"- {line}" for line in wrong]
    if skipped:
        lines += ["", "Calls a system does not take (skipped):", ""] + [
            f"- {name} on {', '.join(labels)}: {reason}" for (name, reason), labels in skipped.items()]
    return lines


def machine_lines_of(run) -> list[str]:
    """The machine lines of a run as ``--json`` writes it (:func:`machine_lines` of the BenchRun)."""
    lines = []
    for case in run["cases"]:
        token = int(case["case"]) if case["matrix"] == "cases" and case["variant"] == "plain" else \
            case["case"] + ("" if case["variant"] == "plain" else f"/{case['variant']}")
        for name in _our_systems(run):
            result = case["results"].get(name)
            if not result or result.get("skipped"):
                continue
            median = _value(result, "median_us")
            lines.append(format_machine_line({
                "case": token, "compiled": result["compiled"], "correct": result["correct"], "backend": name,
                "runtime": _rounded(median and median / 1e3, 4),
                "ref_runtime": _rounded(case["baseline_us"] and case["baseline_us"] / 1e3, 4),
                "speedup": _rounded(_value(result, "speedup"), 4),
                "bw_gbps": _rounded(_value(result, "bandwidth_gbps"), None),
                "bw_fraction": _rounded(_value(result, "fraction_of_ceiling"), 2)}))
    return lines


def markdown(run: dict) -> str:
    """The markdown page of a run as ``--json`` writes it (:func:`run_to_dict`): provenance, the times
    of our backends and the baseline, every system's, the summary figures the run supports (wins and
    geometric means over the baseline, host time against a torch launch, the headroom over FA2),
    correctness and the machine lines. Computed from the run alone, so a page never cites a number
    its run does not hold."""
    lines = ["# Benchmarks", "",
             "<!-- Generated from the run's JSON by flashdecode/bench/report.py (`flashdecode bench --markdown` or "
             "`python -m flashdecode.bench.report RUN.json`); edit the generator, not this page. -->", "",
             f"`flashdecode bench` on {run['device']}: {len(run['cases'])} calls "
             f"({', '.join(dict.fromkeys(case['matrix'] for case in run['cases']))} matrix; variants "
             f"{', '.join(dict.fromkeys(case['variant'] for case in run['cases']))}), "
             f"{len(run['systems'])} systems timed in the same process.", ""]
    lines += _provenance(run) + _results(run) + _every_system(run) + _summary(run) + _correctness(run)
    lines += ["", "## Machine lines", "", "```"] + machine_lines_of(run) + ["```"]
    return "\n".join(lines) + "\n"


def write_markdown(run, path) -> None:
    """The markdown page of a BenchRun (``flashdecode bench --markdown PATH``)."""
    pathlib.Path(path).write_text(markdown(run_to_dict(run)))


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


#: What a process measures for itself, told per part in a merged run's notes.
_PER_PROCESS_SETTINGS = ("torch_launch_us", "torch_launch_gpu_us")
#: The code is named by its digests: a commit of docs between the parts does not stop a merge.
_SAME_IN_EVERY_PART = ("device", "cuda", "versions", "source_digest", "extension_digest", "systems")
PARTIAL_NOTE = "partial: "


def merge_runs(parts: list[dict]) -> dict:
    """One run from runs of other cases (as ``--json`` writes them) by the same code on the same
    device, systems and settings: a run longer than one process may take, measured as several
    ``flashdecode bench --cases`` runs. The first part's ceiling, floor and date head the page; each
    result keeps its fraction of its own process's ceiling, and a note gives every part's (with the
    partial note of a part cut short). ValueError names what differs or which case runs are measured
    twice. One run is returned as it is."""
    if not parts:
        raise ValueError("merge_runs: no runs")
    first = parts[0]
    if len(parts) == 1:
        return first
    for index, part in enumerate(parts[1:], 2):
        for key in _SAME_IN_EVERY_PART:
            if part.get(key) != first.get(key):
                raise ValueError(f"merge_runs: run {index} has another {key} than run 1")
        differ = [key for key in {*first["settings"], *part["settings"]} - set(_PER_PROCESS_SETTINGS)
                  if part["settings"].get(key) != first["settings"].get(key)]
        if differ:
            raise ValueError(f"merge_runs: run {index} has other settings than run 1: {', '.join(sorted(differ))}")
    seen, cases = set(), []
    for part in parts:
        for case in part["cases"]:
            key = (case["matrix"], case["case"], case["variant"])
            if key in seen:
                raise ValueError(f"merge_runs: case {case['case']} {case['variant']} ({case['matrix']}) is in two runs")
            seen.add(key)
            cases.append(case)
    told = [f"cases {', '.join(dict.fromkeys(case['case'] for case in part['cases']))}: run of {part['date']} "
            f"at commit {part.get('git_commit') or 'unknown'}, "
            f"ceiling {part['ceiling']['gbps']:.0f} GB/s, one torch launch "
            f"{_us(part['settings'].get('torch_launch_us'))} µs of host time, "
            f"{_us(part['settings'].get('torch_launch_gpu_us'))} µs of GPU time"
            + "".join(f" ({note})" for note in part["notes"] if note.startswith(PARTIAL_NOTE)) for part in parts]
    notes = [note for part in parts for note in part["notes"] if not note.startswith(PARTIAL_NOTE)]
    return {**first, "skipped": list(dict.fromkeys(reason for part in parts for reason in part["skipped"])),
            "notes": [*dict.fromkeys(notes), f"merged from {len(parts)} runs (fractions of the ceiling are each "
                      "run's own): " + "; ".join(told)],
            "cases": cases}


def main(argv=None) -> None:
    """``python -m flashdecode.bench.report RUN.json [RUN.json ...]``: print the run's markdown page;
    several runs of other cases are merged into one (:func:`merge_runs`), ``--json`` writes it."""
    parser = argparse.ArgumentParser(prog="python -m flashdecode.bench.report", description=main.__doc__)
    parser.add_argument("runs", type=pathlib.Path, nargs="+", metavar="RUN.json",
                        help="a run's JSON (flashdecode bench --json)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write the merged run as JSON")
    args = parser.parse_args(argv)
    parts = []
    for path in args.runs:
        if not path.is_file():
            parser.error(f"no run at {path}")
        try:
            part = json.loads(path.read_text())
        except ValueError as error:
            parser.error(f"{path} is no JSON: {error}")
        if not candidates.is_bench_run(part):
            parser.error(f"{path} is no run of flashdecode bench --json (it lacks device, settings or cases)")
        parts.append(part)
    try:
        run = merge_runs(parts)
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        write_run_dict(run, args.json)
    print(markdown(run), end="")


if __name__ == "__main__":
    main()
