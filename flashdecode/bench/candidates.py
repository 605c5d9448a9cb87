"""The candidates log (``results/candidates.jsonl``): one record per (run, case, variant, our
backend), ranked per case by technique, with a flag where a case has stopped improving.

A record's ``technique`` names what ran: the backend, the plan's kernel and its tile config, and
the schedule's merge flags, e.g. ``triton split(block_n=64, block_m=16, num_warps=4, ...)
+dependent_combine``; so candidates that ran the same code path group together, and a new kernel
or config shows as a new technique. Records come from a run's JSON (``report.run_to_dict``), so a
live run and a committed JSON file give the same records. Nothing here imports Triton.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re

from .. import cases

#: A run's case shape fields that spell a shape of ``bench --shapes``.
SHAPE_FIELDS = ("batch", "seqlen_cache", "nheads_k", "group", "headdim", "lengths")
#: Plan flags that name a technique when set (``planner.Plan``).
TECHNIQUE_FLAGS = ("merge_in_split", "dependent_combine")
#: A case stagnates after this many candidates in a row without a gain ...
STALL_CANDIDATES = 3
#: ... a gain being a runtime at least this fraction below the best before it.
MIN_GAIN = 0.01
NEXT_STEPS = ("re-profile it ({profile}), check the patterns A-M against the report (docs/diagnosis.md), "
              "search the known techniques (docs/patterns/)")


def profile_command(case: str | int) -> str:
    """The ``flashdecode profile`` command of a log's case: a matrix case by its label ("7", "7/q4",
    "W3/paged16"), a shape of ``bench --shapes`` as it is spelled ("16x2048x1x71x64:uniform/q4").
    A log written before shapes were named by their spelling names one by its run's label ("S1"),
    which says nothing of the shape: the advice is then to rebuild the log."""
    label, _, variant = str(case).partition("/")
    if re.fullmatch(r"S\d+", label):
        return "its shape is named by its run's label only: rebuild the log with --from-runs, then profile"
    flag = "--case" if label in cases.CASES_BY_LABEL else "--shape"
    return f"flashdecode profile {flag} {label}" + (f" --variant {variant}" if variant else "")


def technique(backend: str, plan: dict | None) -> str:
    """The technique of a record: backend, kernel(config) and the plan's set flags; the backend
    alone when the run recorded no plan that names its kernel."""
    if not plan or "kernel" not in plan:
        return backend
    config = ", ".join(f"{key}={value}" for key, value in (plan.get("config") or {}).items() if value is not None)
    flags = "".join(f" +{flag}" for flag in TECHNIQUE_FLAGS if plan.get(flag))
    return f"{backend} {plan['kernel']}({config}){flags}"


def case_token(case: dict) -> str | int:
    """A run's case as the log names it: as machine lines do (``results.CaseRun.token``: the number of
    a plain case of the 14-case matrix, else "label" or "label/variant"), but a shape of ``bench
    --shapes`` by its spelling, not its label: S1 is whatever a run's first shape was."""
    label, matrix, variant = case["case"], case.get("matrix", "cases"), case.get("variant", "plain")
    if matrix == "cases" and variant == "plain":
        return int(label)
    if matrix == "shapes":
        given = case.get("matrix_shape") or case["shape"]  # as given: a run without CUDA scales "shape" down
        label = cases.Case(0, **{field: given[field] for field in SHAPE_FIELDS}).spelling
    return label + ("" if variant == "plain" else f"/{variant}")


def records(run: dict) -> list[dict]:
    """One record per (case, variant, our backend) that took the call, from a run as
    ``report.run_to_dict`` gives it (or a JSON file ``--json`` wrote). The id is a digest of the
    run's date, the case and the backend: rebuilding the log gives the same ids."""
    found = []
    for case in run["cases"]:
        token = case_token(case)
        for backend, result in case["results"].items():
            if result.get("kind") != "ours" or result.get("skipped"):
                continue
            median = result.get("median_us")
            baseline = case.get("baseline_us")
            key = f"{run['date']} {token} {backend}"
            found.append({
                "id": hashlib.sha1(key.encode()).hexdigest()[:32], "timestamp": run["date"],
                "git_commit": run.get("git_commit"), "source_digest": run.get("source_digest"),
                "extension_digest": run.get("extension_digest"), "device": run["device"],
                "case": token, "matrix": case.get("matrix", "cases"), "variant": case.get("variant", "plain"),
                "backend": backend, "technique": technique(backend, result.get("plan")),
                "config": result.get("plan"), "validation": "pass" if result.get("correct") else "fail",
                "runtime_ms": median / 1e3 if isinstance(median, (int, float)) else None,
                "ref_runtime_ms": baseline / 1e3 if isinstance(baseline, (int, float)) else None,
                "speedup": result.get("speedup") if isinstance(result.get("speedup"), (int, float)) else None})
    return found


def is_bench_run(data) -> bool:
    """Whether JSON data is a run as ``flashdecode bench --json`` writes it (``report.run_to_dict``)."""
    return isinstance(data, dict) and {"device", "settings", "cases"} <= data.keys()


def from_runs(paths) -> tuple[list[dict], list[str]]:
    """(records of the bench runs' JSON files, one per id, in timestamp order; the files left out:
    not a bench run, or plans that do not name their kernel, from before ``Plan.kernel``)."""
    found, left_out = {}, []
    for path in paths:
        run = json.loads(pathlib.Path(path).read_text())
        if not is_bench_run(run):
            left_out.append(f"{path}: not a bench run")
            continue
        made = records(run)
        if any(record["config"] is not None and "kernel" not in record["config"] for record in made):
            left_out.append(f"{path}: its plans do not name their kernel")
            continue
        found.update((record["id"], record) for record in made)
    return sorted(found.values(), key=lambda record: record["timestamp"]), left_out


def write(found: list[dict], path) -> None:
    """The records as a jsonl file (replaced)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record, allow_nan=False) + "\n" for record in found))


#: The fields of a record the ranking reads.
RECORD_FIELDS = frozenset(("timestamp", "device", "case", "technique", "validation", "runtime_ms"))


def read(path) -> list[dict]:
    """The records of a jsonl file, in file order; ValueError naming the first line that is not
    a record (a JSON object with ``RECORD_FIELDS``)."""
    found = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not RECORD_FIELDS <= record.keys():
            missing = sorted(RECORD_FIELDS - record.keys()) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"line {number} is not a candidate record (missing: {missing})")
        found.append(record)
    return found


@dataclasses.dataclass(frozen=True)
class TechniqueRank:
    """One technique's best passing record on a case, and how many candidates it had there."""

    technique: str
    best: dict
    candidates: int


@dataclasses.dataclass(frozen=True)
class CaseRanking:
    device: str
    case: str | int
    techniques: list[TechniqueRank]  # fastest first
    candidates: int  # records with a passing runtime
    failed: int  # records that did not validate
    since_gain: int  # candidates (in time order) since the last one that beat the best before it
    last_gain: dict | None  # that record
    stall: int  # candidates without a gain that make the case stagnate

    @property
    def stagnating(self) -> bool:
        return self.since_gain >= self.stall


def _passing(record: dict) -> bool:
    return record.get("validation") == "pass" and isinstance(record.get("runtime_ms"), (int, float))


def rank(found: list[dict], stall: int = STALL_CANDIDATES, min_gain: float = MIN_GAIN) -> list[CaseRanking]:
    """Per (device, case), in order of first appearance: its techniques ranked by their best passing
    runtime, and the candidates since the last gain (records in timestamp order; a gain: a
    runtime below (1 - ``min_gain``) x the best before it; the first candidate is one)."""
    groups: dict[tuple, list[dict]] = {}
    for record in found:
        groups.setdefault((record["device"], record["case"]), []).append(record)
    rankings = []
    for (device, case), group in groups.items():
        passing = sorted((r for r in group if _passing(r)), key=lambda r: r["timestamp"])
        best: dict[str, TechniqueRank] = {}
        for record in passing:
            held = best.get(record["technique"])
            count = 1 + (held.candidates if held else 0)
            top = record if held is None or record["runtime_ms"] < held.best["runtime_ms"] else held.best
            best[record["technique"]] = TechniqueRank(record["technique"], top, count)
        best_so_far, since, last_gain = None, 0, None
        for record in passing:
            if best_so_far is None or record["runtime_ms"] < (1 - min_gain) * best_so_far:
                since, last_gain = 0, record
            else:
                since += 1
            best_so_far = record["runtime_ms"] if best_so_far is None else min(best_so_far, record["runtime_ms"])
        rankings.append(CaseRanking(device, case, sorted(best.values(), key=lambda t: t.best["runtime_ms"]),
                                    len(passing), len(group) - len(passing), since, last_gain, stall))
    return rankings


def format_rankings(rankings: list[CaseRanking], top: int) -> str:
    """The report ``flashdecode candidates`` prints: per case its ``top`` techniques, and the
    stagnation flag with the next steps."""
    lines = []
    for ranking in rankings:
        lines.append(f"case {ranking.case} on {ranking.device}: {ranking.candidates} passing candidates, "
                     f"{ranking.failed} failed, {len(ranking.techniques)} techniques")
        for place, entry in enumerate(ranking.techniques[:top], start=1):
            best = entry.best
            speedup = f"{best['speedup']:.3f}x" if isinstance(best.get("speedup"), (int, float)) else "-"
            lines.append(f"  {place:>2}. {best['runtime_ms'] * 1e3:9.2f} us {speedup:>8}  x{entry.candidates:<3} "
                         f"{best['timestamp'][:10]} {(best.get('git_commit') or 'unknown')[:8]}  {entry.technique}")
        if ranking.stagnating:
            gain = ranking.last_gain
            lines.append(f"  STAGNATING: {ranking.since_gain} candidates since the last gain"
                         f" ({gain['timestamp'][:10]}, {gain['runtime_ms'] * 1e3:.2f} us): "
                         + NEXT_STEPS.format(profile=profile_command(ranking.case)))
    return "\n".join(lines)
