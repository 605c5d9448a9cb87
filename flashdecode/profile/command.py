"""``flashdecode profile``: arguments, the device run (timing, trace, counters) or the plan-only report."""
from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import sys

import torch

import flashdecode
from .. import hardware
from ..kernels.base import get_backend, why_not
from ..bench.timing import CallFailed, Timer, summarize
from . import ncu, timeline
from . import shape as shapes
from .report import Measurements, build, notes_for, plan_only, section, write

BACKENDS = ("tilelang", "triton")


def _folder(text: str) -> pathlib.Path:
    """argparse type: a folder's path, not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("name a folder for the report")
    return pathlib.Path(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shapes.add_arguments(parser)
    parser.add_argument("--backend", choices=BACKENDS,
                        help="kernel backend (default: what backend=\"auto\" runs; without CUDA, the plan of the "
                             "backend auto runs on each hardware profile)")
    parser.add_argument("--out", metavar="DIR", type=_folder,
                        help="where report.md, report.json, trace.json, graph-trace.json and ncu.csv go "
                             "(default: profiles/<case>-<backend>)")
    parser.add_argument("--ncu", default="ncu", metavar="PATH",
                        help="the Nsight Compute command (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Resolve the shape and backend, profile (or plan only without CUDA), write and print the report."""
    parser = args.command_parser
    try:
        shape = shapes.from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.out is not None:  # a folder to write into, checked before anything is measured
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--out: cannot make the folder {args.out}: {error.strerror}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.backend is not None:  # without CUDA, what the problem alone decides (the plan-only report)
        problem = shape.problem()
        if cuda:
            reason, what = why_not(args.backend, problem, device), "run here"
        else:
            reason, what = get_backend(args.backend).problem_limitation(problem), "take this call"
        if reason is not None:
            parser.error(f"backend {args.backend!r} cannot {what}: it needs {reason}")
    if args.backend is None and cuda:
        inputs = shape.call(device)
        backend = flashdecode.plan_for(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs()).backend
        del inputs
    else:
        backend = args.backend
    out = args.out or pathlib.Path("profiles") / f"{shape.label}-{backend or 'plan'}"
    report = measure(shape, backend, out, args.ncu) if cuda else plan_only(shape, backend)
    json_path, md_path = write(report, out)
    print(md_path.read_text())
    print(f"flashdecode profile: wrote {md_path} and {json_path}", file=sys.stderr)
    return 0


def measure(shape: shapes.Shape, backend: str, out: pathlib.Path, ncu_command: str) -> dict:
    """Time the call and the ceiling, trace one call, collect counters under ncu; build the report."""
    import triton  # these import Triton: only here, where a device is measured

    from ..bench.ceiling import measure_ceiling
    from ..bench.provenance import git_commit
    from ..bench.runner import CUDA_ITERS, CUDA_WARMUP

    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    inputs = shape.call(device)

    def call():
        return flashdecode.flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs(),
                                                   backend=backend)

    timer = Timer(device, CUDA_ITERS, CUDA_WARMUP)
    measured = Measurements(ceiling_gbps=measure_ceiling(timer).gbps, call_us=timer.time(call).median_us)
    try:
        measured.activity = timeline.capture(call, timer.flush_bytes, out / "trace.json")
    except Exception as error:  # noqa: BLE001 - no trace is reported, the profile goes on
        measured.errors["timeline"] = f"torch.profiler failed: {type(error).__name__}: {error}"
    if not measured.activity and "timeline" not in measured.errors:
        measured.errors["timeline"] = "the trace holds no device activity for the call"
    trace_graph(call, timer, out / "graph-trace.json", measured)
    measured.counters = ncu.collect([*shape.argv(), "--backend", backend], out, ncu_command)
    if measured.counters.csv_text:
        (out / "ncu.csv").write_text(measured.counters.csv_text)
    profile = hardware.current()
    extra = {
        "device": torch.cuda.get_device_name(),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "triton": triton.__version__, "flashdecode": flashdecode.__version__,
                        "git_commit": git_commit(),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "ncu_command": measured.counters.command or None,
        "files": {"trace": "trace.json" if measured.activity else None,
                  "graph_trace": "graph-trace.json" if measured.graph_activity else None,
                  "ncu_csv": "ncu.csv" if measured.counters.csv_text else None,
                  "ncu_report": "ncu.ncu-rep" if measured.counters.kernels else None},
    }
    return build(shape, backend, "measured", [section(shape, profile, measured, backend)], notes_for(measured), extra)


def trace_graph(call, timer: Timer, trace_path: pathlib.Path, measured: Measurements) -> None:
    """The call captured once in a CUDA graph (``Timer.capture``), its replays timed as the
    benchmark's are (``Timer.replays``: warmed up, cold L2) and one traced, into ``measured``
    (``graph_us``, ``graph_activity``); what failed goes to ``measured.errors["graph"]``. A replay
    has no host launches between its kernels: the gaps left in its trace are the device's own."""
    if not timer.cuda:
        measured.errors["graph"] = "CUDA graphs need a CUDA device"
        return
    captured = timer.capture(call)
    if captured is None:
        measured.errors["graph"] = "the call could not be captured in a CUDA graph"
        return
    replay = captured[0].replay
    try:
        measured.graph_us = summarize(timer.replays([replay])[0]).median_us
        measured.graph_activity = timeline.capture(replay, timer.flush_bytes, trace_path)
    except Exception as error:  # noqa: BLE001 - reported, the profile goes on
        cause = error.error if isinstance(error, CallFailed) else error
        measured.errors["graph"] = f"a replay failed: {type(cause).__name__}: {cause}"
        return
    if not measured.graph_activity:
        measured.errors["graph"] = "the trace holds no device activity for the replay"
