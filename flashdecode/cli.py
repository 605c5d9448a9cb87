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
from .argtypes import positive_int


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names, duplicates dropped; "none" for the empty list."""
    found = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    return () if found == ("none",) else found


def _add_bench(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="time a case matrix for our backends and every importable peer",
        description="Time flash_attn_with_kvcache on a case matrix and its variants (cold L2, CUDA events, CUDA-graph "
                    "replay, host time per call, an eager loop over layers) next to FlashAttention 2, FlashInfer, "
                    "torch SDPA and flex_attention, check every output against the reference, and report bandwidth "
                    "against an in-run ceiling. Without CUDA: scaled-down cases under Triton's interpreter, "
                    "CPU timings.")
    add_case_selection(parser, default_variants=("plain",))
    parser.add_argument("--backends", type=names, default=None,
                        help="our backends, e.g. tilelang,triton (default: all that can run here)")
    parser.add_argument("--peers", type=names, default=None,
                        help="peers: fa2,flashinfer-tc,flashinfer-cc,flashinfer-single,sdpa,flex or none (default: "
                             "all that import); a named peer that cannot run is an error")
    parser.add_argument("--iters", type=positive_int, default=None,
                        help="timed runs per result (default 100 on CUDA, at least 50; 3 on CPU)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--cold-cache", dest="warm_cache", action="store_false", default=False,
                       help="flush L2 before each timed run (the default)")
    cache.add_argument("--warm-cache", dest="warm_cache", action="store_true",
                       help="do not flush L2 before each timed run")
    parser.add_argument("--machine", action="store_true",
                        help="print one CASE:... BACKEND:... line per (case, variant, our backend) after the table")
    parser.add_argument("--json", metavar="PATH", help="write the whole run as JSON")
    parser.add_argument("--csv", metavar="PATH", help="write one CSV row per (case, variant, system)")
    parser.add_argument("--plot", metavar="PATH.png", help="plot achieved bandwidth per case and system")
    parser.add_argument("--markdown", metavar="PATH.md",
                        help="write the run's markdown page (provenance, tables, summary; as docs/benchmarks.md)")
    parser.add_argument("--record", metavar="PATH",
                        help="append one JSON line per (case, variant, our backend) to PATH (default: none)")
    parser.set_defaults(handler=_run_bench, command_parser=parser)


def _run_bench(args) -> int:
    """Resolve everything that can fail up front, run, then write every requested output."""
    import torch

    parser = args.command_parser
    selected = selected_cases(args)
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
    for flag in ("json", "csv", "plot", "markdown", "record"):  # before the timing, not after it
        _require_writable_file(parser, f"--{flag}", getattr(args, flag))

    from .bench import BenchError, report, runner

    options = runner.Options(cases=selected, variants=args.variant, backends=args.backends, peers=args.peers,
                             iters=args.iters, cold_l2=not args.warm_cache)
    try:
        selection = runner.select(options)
    except BenchError as error:
        parser.error(str(error))
    if not selection.systems:
        parser.error("nothing to run: no backend and no peer selected")
    progress = report.Progress(selection.steps)
    try:
        # the JSON also after each case, so a run cut by a time limit keeps what it measured
        run = runner.run(selection, progress.advance,
                         (lambda so_far: report.write_json(so_far, args.json)) if args.json else None)
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
    if args.markdown:
        report.write_markdown(run, args.markdown)
    if args.record:
        report.append_records(run, args.record)
    failed = [f"case {c.case.label} {c.variant.name} {r.system}" for c in run.cases for r in c.results
              if r.kind == "ours" and not r.correct and not r.skipped]
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


def _add_candidates(subparsers) -> None:
    from .bench import candidates

    parser = subparsers.add_parser(
        "candidates", help="rank the candidates log per case by technique; flag cases that stopped improving",
        description="Read a candidates log (bench --record) and print, per case and device, its techniques "
                    "(backend, kernel, tile config, merge flags) ranked by their best passing runtime; a case whose "
                    f"last {candidates.STALL_CANDIDATES} candidates (or --stall) brought no gain of "
                    f"{candidates.MIN_GAIN:.0%} is flagged STAGNATING with the next steps (docs/optimising.md).")
    parser.add_argument("--file", default="results/candidates.jsonl", metavar="PATH",
                        help="the candidates log (default: %(default)s)")
    parser.add_argument("--case", type=names, default=(),
                        help="cases as the log names them, e.g. 10,W3,7/q4, a --shapes shape as spelled "
                             "(1x8x1x1x64:equal) (default: all)")
    parser.add_argument("--top", type=positive_int, default=5, help="techniques shown per case (default %(default)s)")
    parser.add_argument("--stall", type=positive_int, default=candidates.STALL_CANDIDATES,
                        help="candidates without a gain that flag a case (default %(default)s)")
    parser.add_argument("--from-runs", nargs="+", metavar="RUN.json",
                        help="first rebuild --file from these bench runs (--json files), replacing it")
    parser.set_defaults(handler=_run_candidates, command_parser=parser)


def _run_candidates(args) -> int:
    """Print the ranking; exit 0 (a stagnating case is advice, not a failure)."""
    from .bench import candidates

    if args.from_runs:
        try:
            rebuilt, left_out = candidates.from_runs(args.from_runs)
        except (OSError, ValueError) as error:
            args.command_parser.error(f"--from-runs: {error}")
        for reason in left_out:
            print(f"flashdecode candidates: left out {reason}", file=sys.stderr)
        if not rebuilt:
            args.command_parser.error(f"--from-runs: no record in {', '.join(args.from_runs)}; "
                                      f"{args.file} left as it was")
        candidates.write(rebuilt, args.file)
        print(f"flashdecode candidates: wrote {len(rebuilt)} records to {args.file}", file=sys.stderr)
    try:
        found = candidates.read(args.file)
    except OSError as error:
        args.command_parser.error(f"--file: cannot read {args.file}: {error.strerror}")
    except ValueError as error:
        args.command_parser.error(f"--file: {args.file} is not a jsonl log: {error}")
    if args.case:
        found = [record for record in found if str(record["case"]) in args.case]
        if not found:
            args.command_parser.error(f"--case: no candidate of {', '.join(args.case)} in {args.file}")
    if not found:
        args.command_parser.error(f"--file: no candidates in {args.file}")
    print(candidates.format_rankings(candidates.rank(found, args.stall), args.top))
    return 0


def _require_writable_file(parser, flag: str, path: str | None) -> None:
    """``path`` (None: not given) as a file to write: not a folder; its folder made where missing."""
    if path is None:
        return
    if os.path.isdir(path):
        parser.error(f"{flag}: {path} is a folder; name a file")
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError as error:
        parser.error(f"{flag}: cannot make the folder of {path}: {error.strerror}")


def _ints(text: str) -> tuple[int, ...]:
    """argparse type: a comma-separated list of integers >= 0 ("" for none)."""
    try:
        values = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        values = (-1,)
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"must be a comma list of integers >= 0, got {text!r}")
    return values


def add_case_selection(parser, default_variants) -> None:
    """--matrix, --cases, --shapes and --variant, as bench, warmup and tools/prewarm.py take them."""
    parser.add_argument("--matrix", choices=tuple(cases.MATRICES), default="cases",
                        help="cases: the 14 cases 1-14 (default); wide: W1-W14 (MHA, MQA, head dims 64/256, ...); "
                             "models: M1-M16 (public models' heads per GPU: groups 1-71, head dims 64-256)")
    parser.add_argument("--cases", default="all",
                        help="cases of the matrix, e.g. 10 or 1,3,7-9 (wide: W2 or W1,W3-W5; models: M1,M5-M7) "
                             "(default: all; none with --shapes)")
    parser.add_argument("--shapes", default="",
                        help="cases of one's own, S1, S2, ...: a comma list of batch x seqlen_cache x nheads_k x "
                             f"group x headdim, ':' and a length rule ({', '.join(cases.LENGTH_RULES[1:])}), e.g. "
                             "16x2048x1x71x64:uniform")
    default = "all" if default_variants == tuple(cases.VARIANTS) else ",".join(default_variants)
    parser.add_argument("--variant", type=names, default=default_variants,
                        help=f"comma list of {', '.join(cases.VARIANTS)} (default: {default})")


def selected_cases(args) -> tuple:
    """The matrix's selected cases, then --shapes' own (only those when --cases is left at all);
    ``args.command_parser``'s error for those and for unknown --variant names (bench, warmup,
    tools/prewarm.py)."""
    unknown = [name for name in args.variant if name not in cases.VARIANTS]
    if not args.variant:
        args.command_parser.error("--variant: name at least one variant")
    if unknown:
        args.command_parser.error(f"unknown variants {unknown}; variants are {', '.join(cases.VARIANTS)}")
    try:
        shapes = cases.parse_shapes(args.shapes)
    except ValueError as error:
        args.command_parser.error(f"--shapes: {error}")
    try:
        selected = () if shapes and args.cases.strip().lower() == "all" else cases.select(args.matrix, args.cases)
    except ValueError as error:
        args.command_parser.error(f"--cases: {error}")
    return tuple(selected) + shapes


def _add_warmup(subparsers) -> None:
    parser = subparsers.add_parser(
        "warmup", help="build TileLang's kernels for a case matrix into TileLang's cache, ahead of the GPU",
        description="Compile, for sm_90a and without a GPU, the TileLang kernels that the planner's plans (H200 "
                    "profile) of a case matrix and its variants launch, forced splits included, into TileLang's "
                    "disk cache (TILELANG_CACHE_DIR); a Hopper GPU then loads them instead of compiling each on "
                    "its first call. Calls TileLang cannot take are skipped.")
    add_case_selection(parser, default_variants=tuple(cases.VARIANTS))
    parser.add_argument("--splits", type=_ints, default=(),
                        help="forced split counts each call is planned with, 0 for the planner's own choice "
                             "(default: 0,2,3)")
    parser.add_argument("--block-n", type=_ints, default=(), help="split-kernel block_n values to build too "
                                                                  "(default: the planned one)")
    parser.add_argument("--stages", type=_ints, default=(), help="split-kernel num_stages values (default: planned)")
    parser.add_argument("--q-rows", type=_ints, default=(), help="split-kernel block_m values, fewest q-tile rows "
                                                                 "(default: planned)")
    parser.add_argument("--shard", default="0/1", help="I/N: build every N-th kernel from the I-th, for N processes "
                                                       "(default: 0/1)")
    parser.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="TileLang's cache folder (sets TILELANG_CACHE_DIR; default: TileLang's own)")
    parser.set_defaults(handler=_run_warmup, command_parser=parser)


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) of an "I/N" shard, 0 <= I < N (warmup's and tools/warmup_tests.py's); ValueError otherwise."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


#: warmup's flag of each split-kernel field (``warmup.tile_variants``).
WARMUP_FLAGS = {"block_n": "--block-n", "num_stages": "--stages", "block_m": "--q-rows"}


def _run_warmup(args) -> int:
    """Resolve the cases, variants and shard, then build (``kernels.tilelang.warmup``)."""
    parser = args.command_parser
    selected = selected_cases(args)
    try:
        shard = parse_shard(args.shard)
    except ValueError as error:
        parser.error(str(error))
    if args.cache_dir:
        if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
            parser.error(f"--cache-dir: {args.cache_dir} is a file; name a folder")
        os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    from .kernels.tilelang.backend import TileLangBackend

    backend = TileLangBackend()
    if backend.unavailable() is not None:
        parser.error(f"building TileLang's kernels needs {backend.unavailable()}")
    from tilelang import env

    from .kernels.tilelang import warmup

    problems = [cases.VARIANTS[name].problem(case) for case in selected for name in args.variant]
    try:
        variants = warmup.tile_variants(block_n=args.block_n, num_stages=args.stages, block_m=args.q_rows)
    except ValueError as error:
        field = str(error).split()[0].removeprefix("config.")
        parser.error(f"{WARMUP_FLAGS.get(field, '--block-n, --stages, --q-rows')}: {error}")
    calls = [(problem, num_splits) for problem in problems for num_splits in args.splits or warmup.DEFAULT_SPLITS]
    entries = warmup.kernels(calls, variants, backend=backend)
    built = warmup.build(entries, shard=shard, backend=backend,
                         on_built=lambda kernel, problem, config: print("built", kernel, problem, config, flush=True))
    print(f"flashdecode warmup: {built} of {len(entries)} kernels built into {env.TILELANG_CACHE_DIR}")


def _add_models_bench(subparsers) -> None:
    parser = subparsers.add_parser(
        "models-bench", help="time whole-model decode steps: sdpa, flash_attention_2 and flashdecode in transformers",
        description="Time one decode step of SmolLM2-135M and Llama-3.1-8B-, Qwen2.5-7B- and Gemma-2-9B-shaped "
                    "models (random bf16 weights) on a StaticCache of 1k-32k random tokens, batch 1/16/64, eager and "
                    "replayed from a CUDA graph, with transformers' sdpa, flash_attention_2 (FLASHDECODE_FA2_PATH) "
                    "and flashdecode; writes rows (ms/step, tokens/s, attention share, correct) as JSON.")
    parser.add_argument("--quick", action="store_true", help="the small grid (2 models, batch 1/16, 1k/8k)")
    parser.add_argument("--models", default="", help="a comma list of models of the grid (default: all)")
    parser.add_argument("--out", default="model-decode.json",
                        help="the JSON rows (default: %(default)s; the committed run is docs/model-decode.json)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda where present; cpu times eager steps of the tiny models only")
    parser.set_defaults(handler=_run_models_bench, command_parser=parser)


def _run_models_bench(args) -> int:
    from .bench import models

    if args.out:
        _require_writable_file(args.command_parser, "--out", args.out)
    try:
        rows = models.run("quick" if args.quick else "default", names(args.models) or None, args.out, args.device)
    except (ImportError, ValueError) as error:
        args.command_parser.error(str(error))
    print(models.table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdecode", description="flashdecode command-line tools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(subparsers)
    _add_profile(subparsers)
    _add_candidates(subparsers)
    _add_warmup(subparsers)
    _add_models_bench(subparsers)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``flashdecode`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args)
