"""Nsight Compute counters: the metrics asked for, the run, the CSV parser and per-kernel figures.

``collect`` profiles ``python -m flashdecode.profile.target`` with
``ncu --clock-control none --profile-from-start off --metrics ...`` (caches flushed before every
kernel, ncu's default), saves the report, and reads it back with
``ncu --import ... --csv --page raw --print-units base``: a row of column names in quotes, a row of
units, then one row per kernel launch. Launches of the same kernel are merged by median.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import pathlib
import re
import shlex
import shutil
import statistics
import subprocess
import sys

import flashdecode

#: The stall reasons asked for (WarpStateStats' counters, in warp cycles per issued instruction).
STALL_REASONS = ("long_scoreboard", "barrier", "mio_throttle", "short_scoreboard", "wait", "math_pipe_throttle",
                 "lg_throttle", "not_selected", "selected", "dispatch_stall", "drain", "imc_miss",
                 "branch_resolving", "no_instruction", "membar", "misc", "sleeping", "tex_throttle")
#: Column names of stall metrics: (prefix, suffix) around the reason; the second family is also read.
STALL_FORMS = (("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"),
               ("smsp__average_warp_latency_issue_stalled_", ".ratio"))
OCCUPANCY_LIMITS = ("registers", "shared_mem", "warps", "blocks")
TENSOR_PIPES = ("hmma", "gmma")
#: Bytes loaded and stored through local memory: register spills (pattern J).
LOCAL_METRICS = ("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum")
METRICS = (
    "gpu__time_duration.sum",
    "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
    "launch__shared_mem_per_block_static", "launch__shared_mem_per_block_dynamic",
    *(f"launch__occupancy_limit_{limit}" for limit in OCCUPANCY_LIMITS),
    "launch__waves_per_multiprocessor",
    "sm__maximum_warps_per_active_cycle_pct", "sm__warps_active.avg.pct_of_peak_sustained_active",
    *(f"{STALL_FORMS[0][0]}{reason}{STALL_FORMS[0][1]}" for reason in STALL_REASONS),
    *(f"sm__pipe_tensor_op_{pipe}_cycles_active.avg.pct_of_peak_sustained_active" for pipe in TENSOR_PIPES),
    *(f"sm__inst_executed_pipe_tensor_op_{pipe}.sum" for pipe in TENSOR_PIPES),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "dram__bytes_read.sum", "dram__bytes_write.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    *LOCAL_METRICS,
)
TIMEOUT_S = 600
#: Runs at most: each failed run naming metrics it does not know drops them and runs again.
ATTEMPTS = 3
#: Known failures, as (text in ncu's output, what the report says).
FAILURES = (
    ("ERR_NVGPUCTRPERM", "no permission to read GPU performance counters (ERR_NVGPUCTRPERM): run as root or "
                         "set the driver option NVreg_RestrictProfilingToAdminUsers=0"),
    ("LibraryNotLoaded", "ncu could not load its libraries (LibraryNotLoaded)"),
)

_PREFIXES = {"": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_SECONDS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}  # to nanoseconds


@dataclasses.dataclass(frozen=True)
class KernelCounters:
    """One kernel of the call: its launches' metrics merged by median (bytes, nanoseconds, %)."""

    name: str
    launches: int
    metrics: dict

    def get(self, metric: str) -> float | None:
        return self.metrics.get(metric)

    @property
    def role(self) -> str:
        return kernel_role(self.name)


@dataclasses.dataclass
class NcuResult:
    kernels: list[KernelCounters]
    error: str | None  # why there are no counters
    command: str = ""
    csv_text: str = ""
    dropped: list[str] = dataclasses.field(default_factory=list)  # metrics this ncu does not know


def kernel_role(name: str) -> str:
    """A kernel's part in the call, from its name: "split", "combine" or "other" (fills, anything not ours)."""
    lowered = name.lower()
    return "combine" if "combine" in lowered else "split" if "split" in lowered else "other"


def _number(text: str, unit: str) -> float | None:
    """A value in base units (bytes, nanoseconds); None for empty or non-numeric cells."""
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    if unit in _SECONDS:
        return value * _SECONDS[unit]
    match = re.fullmatch(r"([KMGT]i?|k)?byte(/second)?", unit)
    return value * _PREFIXES[match.group(1) or ""] if match else value


def parse_csv(text: str) -> list[dict]:
    """One dict per kernel launch: metric columns (names with "__") as numbers or None, others as text.

    Lines before the header (ncu's ==PROF== messages) are skipped; a units row follows the header
    when its first cell is empty.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    header, body = rows[0], rows[1:]
    units = [""] * len(header)
    if body and body[0] and body[0][0] == "":
        units, body = body[0], body[1:]
    launches = []
    for row in body:
        if len(row) != len(header):
            continue
        launches.append({name: _number(cell, unit) if "__" in name else cell
                         for name, cell, unit in zip(header, row, units)})
    return launches


def merge(launches: list[dict]) -> list[KernelCounters]:
    """Group launches by kernel name (order of first launch) with the median of each metric."""
    groups: dict[str, list[dict]] = {}
    for launch in launches:
        groups.setdefault(launch.get("Kernel Name", "?"), []).append(launch)
    kernels = []
    for name, group in groups.items():
        metrics = {}
        for metric in (key for key in group[0] if "__" in key):
            values = [launch[metric] for launch in group if launch.get(metric) is not None]
            metrics[metric] = statistics.median(values) if values else None
        kernels.append(KernelCounters(name, len(group), metrics))
    return kernels


def main_kernel(kernels: list[KernelCounters]) -> KernelCounters:
    """The split kernel, or the longest one when no name says "split"."""
    split = [k for k in kernels if k.role == "split"]
    return split[0] if split else max(kernels, key=lambda k: k.get("gpu__time_duration.sum") or 0.0)


def resident_programs(kernel: KernelCounters) -> int | None:
    """Programs per multiprocessor at once: the tightest of ncu's occupancy limits."""
    limits = [kernel.get(f"launch__occupancy_limit_{limit}") for limit in OCCUPANCY_LIMITS]
    limits = [limit for limit in limits if limit is not None]
    return int(min(limits)) if limits else None


def stall_shares(kernel: KernelCounters) -> dict[str, float] | None:
    """Each stall reason's share of all stall cycles, largest first; None without stall metrics."""
    raw = {}
    for metric, value in kernel.metrics.items():
        for prefix, suffix in STALL_FORMS:
            if value is not None and metric.startswith(prefix) and metric.endswith(suffix):
                raw[metric[len(prefix):-len(suffix)]] = value
    total = sum(raw.values())
    if not total:
        return None
    return dict(sorted(((reason, value / total) for reason, value in raw.items()), key=lambda kv: -kv[1]))


def kernel_row(kernel: KernelCounters) -> dict:
    """The per-kernel line of the report's kernel table."""
    time_ns, shared = kernel.get("gpu__time_duration.sum"), _shared_bytes(kernel)
    return {"kernel": kernel.name, "role": kernel.role, "launches": kernel.launches,
            "time_us": None if time_ns is None else time_ns / 1e3,
            "grid": kernel.get("launch__grid_size"), "block": kernel.get("launch__block_size"),
            "registers": kernel.get("launch__registers_per_thread"), "shared_bytes": shared,
            "resident": resident_programs(kernel),
            "achieved_occupancy_pct": kernel.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
            "dram_read_bytes": kernel.get("dram__bytes_read.sum")}


def _shared_bytes(kernel: KernelCounters) -> float | None:
    parts = [kernel.get(f"launch__shared_mem_per_block_{kind}") for kind in ("static", "dynamic")]
    return None if all(part is None for part in parts) else sum(part or 0.0 for part in parts)


def occupancy_figures(kernel: KernelCounters) -> dict:
    """Dimension 1's counters for the main kernel."""
    theoretical = kernel.get("sm__maximum_warps_per_active_cycle_pct")
    achieved = kernel.get("sm__warps_active.avg.pct_of_peak_sustained_active")
    return {
        "registers_per_thread": kernel.get("launch__registers_per_thread"),
        "shared_mem_per_program": _shared_bytes(kernel),
        "occupancy_limits": {limit: kernel.get(f"launch__occupancy_limit_{limit}") for limit in OCCUPANCY_LIMITS},
        "theoretical_occupancy_pct": kernel.get("sm__maximum_warps_per_active_cycle_pct"),
        "achieved_occupancy_pct": achieved,
        "achieved_over_theoretical": achieved / theoretical if achieved is not None and theoretical else None,
        "ncu_waves_per_sm": kernel.get("launch__waves_per_multiprocessor"),
    }


def stall_figures(kernel: KernelCounters) -> dict:
    """Dimension 3 for the main kernel: stall shares and shared-memory bank conflicts."""
    shares = stall_shares(kernel)
    conflicts = kernel.get("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")
    wavefronts = kernel.get("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum")
    ratio = None
    if conflicts is not None and wavefronts is not None:
        ratio = conflicts / wavefronts if wavefronts else 0.0
    return {
        "stall_shares": shares,
        "top_stall": next(iter(shares)) if shares else None,
        "long_scoreboard_share": shares.get("long_scoreboard", 0.0) if shares else None,
        "barrier_share": shares.get("barrier", 0.0) if shares else None,
        "shared_bank_conflicts": conflicts,
        "shared_wavefronts": wavefronts,
        "bank_conflict_ratio": ratio,
    }


def local_bytes(kernels: list[KernelCounters]) -> float | None:
    """Bytes all kernels moved through local memory (spills), or None when ncu gave no such metric."""
    values = [kernel.get(metric) for kernel in kernels for metric in LOCAL_METRICS]
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def tensor_figures(kernel: KernelCounters) -> dict:
    """Dimension 4 for the main kernel: mma.sync (hmma) and Hopper wgmma (gmma) pipe activity."""
    active = {pipe: kernel.get(f"sm__pipe_tensor_op_{pipe}_cycles_active.avg.pct_of_peak_sustained_active")
              for pipe in TENSOR_PIPES}
    known = [value for value in active.values() if value is not None]
    figures = {"tensor_active_pct": max(known) if known else None}
    for pipe in TENSOR_PIPES:
        figures[f"{pipe}_active_pct"] = active[pipe]
        figures[f"{pipe}_instructions"] = kernel.get(f"sm__inst_executed_pipe_tensor_op_{pipe}.sum")
    return figures


def explain_failure(log: str, returncode: int | None) -> str:
    """What the report says when ncu gave no counters."""
    for marker, message in FAILURES:
        if marker in log:
            return message
    tail = " | ".join(line.strip() for line in log.strip().splitlines()[-4:])
    return f"ncu gave no kernel rows (exit status {returncode}): {tail or 'no output'}"


def unknown_metrics(log: str, metrics: list[str]) -> list[str]:
    """Metrics an ncu error line names (e.g. "==ERROR== Failed to find metric X")."""
    errors = [line for line in log.splitlines() if "ERROR" in line and "metric" in line.lower()]
    return [m for m in metrics if any(re.search(rf"(?<![\w.]){re.escape(m)}(?![\w.])", e) for e in errors)]


def profile_command(ncu: str, metrics: list[str], report: pathlib.Path, target_argv: list[str]) -> list[str]:
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", ",".join(metrics),
            "--export", str(report), "--force-overwrite",
            sys.executable, "-m", "flashdecode.profile.target", *target_argv]


def import_command(ncu: str, report: pathlib.Path) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]


def collect(target_argv: list[str], out_dir: pathlib.Path, ncu: str = "ncu") -> NcuResult:
    """Profile the target under ncu; the report lands in ``out_dir/ncu.ncu-rep``. Never raises for
    ncu's own failures: they come back as ``error``."""
    executable = shutil.which(ncu)
    if executable is None:
        return NcuResult([], f"ncu not found: {ncu!r} is not an executable on PATH")
    report = pathlib.Path(out_dir) / "ncu.ncu-rep"
    report.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    root = str(pathlib.Path(flashdecode.__file__).resolve().parents[1])  # the target imports this flashdecode
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    metrics, dropped = list(METRICS), []
    for _ in range(ATTEMPTS):
        command = profile_command(executable, metrics, report, target_argv)
        report.unlink(missing_ok=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
            log, status = done.stdout + done.stderr, done.returncode
            if report.exists():
                imported = subprocess.run(import_command(executable, report), capture_output=True, text=True,
                                          timeout=TIMEOUT_S)
                log += imported.stderr
                kernels = merge(parse_csv(imported.stdout))
                if kernels:
                    return NcuResult(kernels, None, shlex.join(command), imported.stdout, dropped)
        except subprocess.TimeoutExpired:
            return NcuResult([], f"ncu did not finish within {TIMEOUT_S} s", shlex.join(command))
        unknown = unknown_metrics(log, metrics)
        if not unknown:
            return NcuResult([], explain_failure(log, status), shlex.join(command))
        dropped += unknown
        metrics = [m for m in metrics if m not in unknown]
    return NcuResult([], f"ncu kept rejecting metrics (dropped {', '.join(dropped)})", shlex.join(command))
