"""The ``flashdecode`` command: ``flashdecode bench ...`` (also ``python -m flashdecode bench``).

Each subcommand is an ``_add_<name>(subparsers)`` that declares its arguments and sets ``handler``
(a function ``args -> exit status``) and ``command_parser`` (its parser, for errors); adding one is
that function plus a line in :func:`build_parser`. Errors the user can fix are reported through
``args.command_parser.error`` (usage, message, exit 2).
"""
from __future__ import annotations

import argparse
import os
import sys

from . import cases


def parse_cases(text: str) -> tuple[int, ...]:
    """Case numbers from "10", "1,3,7-9" or "all"; ArgumentTypeError for anything else."""
    if text.strip().lower() == "all":
        return tuple(case.number for case in cases.CASES)
    numbers = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid case list {text!r}: use numbers and ranges like 1,3,7-9") from None
        if first > last:
            raise argparse.ArgumentTypeError(f"invalid case range {part.strip()!r} in {text!r}")
        for number in range(first, last + 1):
            if number not in cases.CASES_BY_NUMBER:
                raise argparse.ArgumentTypeError(f"unknown case {number} in {text!r}: cases are 1-{len(cases.CASES)}")
            if number not in numbers:
                numbers.append(number)
    return tuple(numbers)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names, duplicates dropped; "none" for the empty list."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    return () if names == ("none",) else names


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _add_bench(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time the 14-case matrix for our backends and every importable peer",
        description="Time flash_decode_with_kvcache on the case matrix (cold L2, CUDA events, CUDA-graph "
                    "replay, host overhead) next to FlashAttention, FlashInfer, torch SDPA and flex_attention, "
                    "check every output against the reference, and report bandwidth against an in-run ceiling. "
                    "Without CUDA: scaled-down cases under Triton's interpreter, CPU timings.")
    parser.add_argument("--cases", type=parse_cases, default=parse_cases("all"),
                        help="case numbers, e.g. 10 or 1,3,7-9 (default: all 14)")
    parser.add_argument("--backends", type=_names, default=None,
                        help="our backends, e.g. tilelang,triton (default: all that can run here)")
    parser.add_argument("--peers", type=_names, default=None,
                        help="peers: fa2,flashinfer,sdpa,flex or none (default: all that import); "
                             "a named peer that cannot run is an error")
    parser.add_argument("--iters", type=positive_int, default=None,
                        help="timed runs per result (default 100 on CUDA, at least 50; 3 on CPU)")
    parser.add_argument("--warm-cache", action="store_true", help="do not flush L2 before each timed run")
    parser.add_argument("--machine", action="store_true",
                        help="print one CASE:... BACKEND:... line per (case, our backend) after the table")
    parser.add_argument("--json", metavar="PATH", help="write the whole run as JSON")
    parser.add_argument("--csv", metavar="PATH", help="write one CSV row per (case, system)")
    parser.add_argument("--plot", metavar="PATH.png", help="plot achieved bandwidth per case and system")
    parser.add_argument("--record", metavar="PATH", default="results/candidates.jsonl",
                        help="append one JSON line per (case, our backend) (default: %(default)s)")
    parser.add_argument("--no-record", action="store_true", help="do not append to the record file")
    parser.set_defaults(handler=_run_bench, command_parser=parser)


def _run_bench(args) -> int:
    """Resolve everything that can fail up front, run, then write every requested output."""
    import torch

    parser = args.command_parser
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # Must precede the first import of Triton (flashdecode.kernels, bench.runner).
        if "triton" in sys.modules:
            parser.error("no CUDA device, and Triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")

    from .bench import BenchError, report, runner

    options = runner.Options(cases=args.cases, backends=args.backends, peers=args.peers,
                             iters=args.iters, cold_l2=not args.warm_cache)
    try:
        selection = runner.select(options)
    except BenchError as error:
        parser.error(str(error))
    if not selection.systems:
        parser.error("nothing to run: no backend and no peer selected")
    progress = report.Progress(selection.steps)
    try:
        run = runner.run(selection, progress.advance)
    finally:
        progress.close()

    print(report.format_table(run))
    if args.machine:
        print("\n".join(report.machine_lines(run)))
    if args.json:
        report.write_json(run, args.json)
    if args.csv:
        report.write_csv(run, args.csv)
    if args.plot:
        report.write_plot(run, args.plot)
    if not args.no_record:
        report.append_records(run, args.record)
    failed = [f"case {c.case.number} {r.system}" for c in run.cases for r in c.results
              if r.kind == "ours" and not r.correct]
    if failed:
        print(f"flashdecode bench: our backends failed on: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _add_profile(subparsers) -> None:
    from .profile import command

    parser = subparsers.add_parser(
        "profile", help="diagnose one case: occupancy, tail, stalls, tensor cores, timeline, bandwidth",
        description="Run one case (or a shape given with flags) and write DIR/report.md and DIR/report.json "
                    "covering six dimensions, each with its figures and a one-line diagnosis "
                    "(docs/diagnosis.md). Counters come from Nsight Compute (ncu), the timeline from "
                    "torch.profiler. Without CUDA: the plan-based dimensions for the H200 and C500 profiles.")
    command.add_arguments(parser)
    parser.set_defaults(handler=command.run, command_parser=parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdecode", description="flashdecode command-line tools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(subparsers)
    _add_profile(subparsers)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``flashdecode`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args)
