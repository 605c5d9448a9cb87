"""How much of a call's GPU time its kernels' own work takes when DRAM is out of the way: the same
paged call over a block table of distinct pages (its bytes come from DRAM) and over one whose
entries repeat ``--resident-pages`` pages (they stay in L2), each replayed from a CUDA graph with L2
flushed before every run, both checked against the reference.

The ratio L2 / DRAM is the loop's floor as a share of the call: near 1, the kernel's instructions,
not the memory system, set its time (more bytes in flight cannot help); well below 1, the gap is
the overlap of loads and work. Calls are the benchmark's (``cases.make_call``) of cases of
``flashdecode.cases`` with their own length rule (``--lengths``: another of ``cases.LENGTH_RULES``),
over pages of ``--page-size`` tokens; fp8 caches are quantised with the fp8 variant's descales.

Usage: python tools/loop_floor.py --cases 7,12,13 --kv bfloat16,float8_e4m3fn [--lengths equal --page-size 64
       --resident-pages 64 --backend triton --block-n 128 --warps 8 --stages 2 --iters 40]
       (--block-n, --warps, --stages: the plan's Triton tile with that field changed and no register cap)
"""
import argparse
import dataclasses

import torch

import flashdecode
from flashdecode import DecodeContext, cases, plan_for
from flashdecode.bench.timing import Timer
from flashdecode.hardware import profile_for
from flashdecode.kernels.base import BackendError, select
from flashdecode.reference import relative_error

TILE_FIELDS = {"block_n": "block_n", "warps": "num_warps", "stages": "num_stages"}


def floor_variant(kv_dtype: str, page_size: int) -> cases.Variant:
    """The benchmark variant of the floor's calls: pages of ``page_size``, the cache in ``kv_dtype``."""
    fp8 = kv_dtype if kv_dtype.startswith("float8") else None
    return cases.Variant(f"paged{page_size}", "loop floor", page_size=page_size, cache_dtype=fp8)


def paged_call(case: cases.Case, kv_dtype: str, page_size: int, resident_pages: int, device: str,
               lengths: str | None = None):
    """The case's call over pages of ``page_size`` (``cases.make_call``: a shuffled block table, an
    fp8 cache quantised with calibrated descales) and its two block tables: the call's own ("dram")
    and one whose entry i, in row order, is page i mod ``resident_pages`` ("l2"); ``lengths``: a
    length rule in place of the case's."""
    variant = floor_variant(kv_dtype, page_size)
    call = cases.make_call(dataclasses.replace(case, lengths=lengths or case.lengths), variant, device)
    table = call.block_table
    resident = torch.arange(table.numel(), device=device, dtype=torch.int32) % min(resident_pages, table.numel())
    return call, {"dram": table, "l2": resident.view_as(table)}


def measure(case: cases.Case, kv_dtype: str, args, timer: Timer, device: str) -> dict:
    """One row: the case's DRAM and L2 times (µs; NaN where nothing could be timed, as on a CPU) and
    the larger relative error of the two calls against the reference."""
    call, tables = paged_call(case, kv_dtype, args.page_size, args.resident_pages, device, args.lengths)
    q, k, v = call.q, call.k_cache, call.v_cache
    extra = {name: value for name, value in call.kwargs().items() if name != "block_table"}
    changes = {field: getattr(args, flag) for flag, field in TILE_FIELDS.items() if getattr(args, flag)}
    context = DecodeContext(device)
    if changes:
        config = plan_for(q, k, v, **extra, block_table=tables["dram"], backend=args.backend).plan.config
        context = DecodeContext(device, config=dataclasses.replace(config, **changes, max_registers=None))
    calls = [lambda table=table: flashdecode.flash_attn_with_kvcache(q, k, v, **extra, block_table=table,
                                                                     backend=args.backend, context=context)
             for table in tables.values()]
    errors = [relative_error(run(), flashdecode.flash_attn_with_kvcache(q, k, v, **extra, block_table=table,
                                                                        backend="reference"))
              for run, table in zip(calls, tables.values())]
    timer.synchronize()
    timed = [found[0].median_us if found else float("nan") for found in timer.time_graphs(calls)]
    return dict(case=case.label, kv=kv_dtype, mb=call.bytes_moved() / 1e6, dram_us=timed[0], l2_us=timed[1],
                error=max(errors))


def table(rows: list[dict]) -> str:
    lines = ["| case | cache | MB moved | DRAM pages µs | L2 pages µs | L2 / DRAM | rel. error |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['kv']} | {r['mb']:.1f} | {r['dram_us']:.2f} | {r['l2_us']:.2f} | "
              f"{r['l2_us'] / r['dram_us']:.2f} | {r['error']:.1e} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="7,12,13", help="cases of flashdecode.cases (default %(default)s)")
    parser.add_argument("--kv", default="bfloat16,float8_e4m3fn", help="cache dtypes (default %(default)s)")
    parser.add_argument("--lengths", choices=cases.LENGTH_RULES, help="a length rule (default: each case's)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--resident-pages", type=int, default=64, help="pages the L2 table repeats (default 64)")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--block-n", type=int)
    parser.add_argument("--warps", type=int)
    parser.add_argument("--stages", type=int)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    selected = [(case, kv_dtype) for case in cases.select("cases", args.cases) for kv_dtype in args.kv.split(",")]
    for case, kv_dtype in selected:  # before any is measured: e.g. bfloat16 under Triton's interpreter, on a CPU
        try:
            select(args.backend, floor_variant(kv_dtype, args.page_size).problem(case), device, profile_for(device))
        except BackendError as error:
            parser.error(f"case {case.label} {kv_dtype} on {args.device}: {error}")
    timer = Timer(device, iters=args.iters, warmup=5)
    rows = []
    for case, kv_dtype in selected:
        rows.append(measure(case, kv_dtype, args, timer, args.device))
        print(rows[-1], flush=True)
    report = table(rows)
    print(report)
    return report


if __name__ == "__main__":
    main()
