"""How much of a call's GPU time its kernels' own work takes when DRAM is out of the way: the same
paged call over a block table of distinct pages (its bytes come from DRAM) and over one whose
entries repeat ``--resident-pages`` pages (they stay in L2), each replayed from a CUDA graph with L2
flushed before every run, both checked against the reference.

The ratio L2 / DRAM is the loop's floor as a share of the call: near 1, the kernel's instructions,
not the memory system, set its time (more bytes in flight cannot help); well below 1, the gap is
the overlap of loads and work. Shapes are cases of ``flashdecode.cases`` with their own length rule
(``--lengths``: another of ``cases.LENGTH_RULES``), cut into pages of ``--page-size`` tokens; fp8
caches take descales of 1.

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

TILE_FIELDS = {"block_n": "block_n", "warps": "num_warps", "stages": "num_stages"}


def paged_inputs(case: cases.Case, kv_dtype: str, page_size: int, resident_pages: int, device: str,
                 lengths: str | None = None):
    """q, the page pools, the case's lengths and the two block tables (distinct pages, a random
    permutation; resident: entry i, in row order, is page i mod ``resident_pages``); ``lengths``: a length
    rule in place of the case's."""
    generator = torch.Generator(device).manual_seed(0)
    pages_per_sequence = -(-case.seqlen_cache // page_size)
    pages = case.batch * pages_per_sequence
    q = torch.randn(case.batch, 1, case.nheads_k * case.group, case.headdim, generator=generator, device=device,
                    dtype=torch.bfloat16)
    k, v = (torch.randn(pages, page_size, case.nheads_k, case.headdim, generator=generator, device=device,
                        dtype=torch.bfloat16).to(getattr(torch, kv_dtype)) for _ in range(2))
    distinct = torch.randperm(pages, generator=generator, device=device).to(torch.int32)
    resident = torch.arange(pages, device=device, dtype=torch.int32) % min(resident_pages, pages)
    seqlens = cases.case_seqlens(case.batch, case.seqlen_cache, lengths or case.lengths).to(device)
    return q, k, v, seqlens, {"dram": distinct.view(case.batch, -1), "l2": resident.view(case.batch, -1)}


def measure(case: cases.Case, kv_dtype: str, args, timer: Timer, device: str) -> dict:
    """One row: the case's DRAM and L2 times (µs; NaN where nothing could be timed, as on a CPU) and
    the larger relative error of the two calls against the reference."""
    q, k, v, seqlens, tables = paged_inputs(case, kv_dtype, args.page_size, args.resident_pages, device,
                                           args.lengths)
    extra = {"cache_seqlens": seqlens}
    if k.element_size() == 1:
        extra.update(k_descale=torch.ones(case.batch, case.nheads_k, device=device),
                     v_descale=torch.ones(case.batch, case.nheads_k, device=device))
    changes = {field: getattr(args, flag) for flag, field in TILE_FIELDS.items() if getattr(args, flag)}
    context = DecodeContext(device)
    if changes:
        config = plan_for(q, k, v, block_table=tables["dram"], backend=args.backend, **extra).plan.config
        context = DecodeContext(device, config=dataclasses.replace(config, **changes, max_registers=None))
    calls = [lambda table=table: flashdecode.flash_attn_with_kvcache(q, k, v, block_table=table, backend=args.backend,
                                                                     context=context, **extra)
             for table in tables.values()]
    errors = []
    for call, table in zip(calls, tables.values()):
        want = flashdecode.flash_attn_with_kvcache(q, k, v, block_table=table, backend="reference", **extra).float()
        errors.append(float((call().float() - want).norm() / want.norm()))
    timer.synchronize()
    timed = [found[0].median_us if found else float("nan") for found in timer.time_graphs(calls)]
    read = 2 * int(seqlens.sum()) * case.nheads_k * case.headdim * k.element_size()
    return dict(case=case.label, kv=kv_dtype, mb=read / 1e6, dram_us=timed[0], l2_us=timed[1], error=max(errors))


def table(rows: list[dict]) -> str:
    lines = ["| case | cache | MB read | DRAM pages µs | L2 pages µs | L2 / DRAM | rel. error |",
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
    timer = Timer(torch.device(args.device), iters=args.iters, warmup=5)
    rows = []
    for case in cases.select("cases", args.cases):
        for kv_dtype in args.kv.split(","):
            rows.append(measure(case, kv_dtype, args, timer, args.device))
            print(rows[-1], flush=True)
    print(table(rows))
    return table(rows)


if __name__ == "__main__":
    main()
