"""Tuning sweep on the GPU: time a backend on the matrix cases over planner knobs.

Times GPU work with the benchmark's Timer (cold L2, the call replayed from a CUDA graph, median of
50), so host overhead does not hide kernel differences, and checks every variant against the
reference in the same run.
Usage: python benchmarks/sweep.py --backend triton --ppsm 2,4,8 --block-n 32,64 --min-chunk 2,4
       python benchmarks/sweep.py --backend tilelang,triton --tl-stages 2,3 --tl-rows 64,16
(--tl-* vary the TileLang split kernel's pipeline depth and q tile rows, and the most tiles of an
unsplit cache its short-cache kernel takes; ignored for Triton.)
Prints one line per (case, variant) and a best-per-case table last; --log PATH keeps the lines.
"""
import argparse
import itertools
import json

import torch

from flashdecode import flash_decode_with_kvcache, planner
from flashdecode.bench.runner import ANCHOR_PATH
from flashdecode.bench.timing import Timer
from flashdecode.cases import CASES, bytes_read, make_inputs
from flashdecode.kernels.tilelang import decode as tilelang_decode
from flashdecode.reference import reference_decode, relative_error


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--ppsm", default=str(planner.PROGRAMS_PER_MULTIPROCESSOR))
    parser.add_argument("--block-n", default=",".join(map(str, planner.BLOCK_N_CANDIDATES[:1])))
    parser.add_argument("--min-chunk", default=str(planner.MIN_BLOCKS_PER_SPLIT))
    parser.add_argument("--tl-stages", default=str(tilelang_decode.NUM_STAGES))
    parser.add_argument("--tl-rows", default=str(tilelang_decode.MIN_Q_ROWS))
    parser.add_argument("--tl-short-max-blocks", default=str(tilelang_decode.SHORT_CACHE_MAX_BLOCKS))
    parser.add_argument("--tl-producer-regs", default=str(tilelang_decode.PRODUCER_REGISTERS),
                        help="registers a TileLang producer thread keeps (setmaxnreg); 0: an even split")
    parser.add_argument("--cases", default="")
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    numbers = [int(c) for c in args.cases.split(",")] if args.cases else [c.number for c in CASES]
    fa2 = {c["case"]: c["fa2"]["median_us"] for c in json.loads(ANCHOR_PATH.read_text())["cases"]}
    rows, best = [], {}
    first_tilelang_knobs = tuple(int(arg.split(",")[0]) for arg in (args.tl_stages, args.tl_rows,
                                                                     args.tl_short_max_blocks, args.tl_producer_regs))
    timer = Timer(torch.device("cuda"), iters=50, warmup=5)
    for case in (c for c in CASES if c.number in numbers):
        q, k, v, seqlens = make_inputs(case, device="cuda")
        expected, _ = reference_decode(q, k, v, seqlens)
        nbytes = bytes_read(seqlens.tolist(), case.nheads_k, case.nheads)
        knobs = itertools.product(args.backend.split(","), *(
            map(int, arg.split(",")) for arg in (args.ppsm, args.block_n, args.min_chunk, args.tl_stages, args.tl_rows,
                                                 args.tl_short_max_blocks, args.tl_producer_regs)))
        for backend, ppsm, block_n, min_chunk, stages, q_rows, short_max, producer_regs in knobs:
            if backend != "tilelang" and (stages, q_rows, short_max, producer_regs) != first_tilelang_knobs:
                continue  # TileLang's knobs do not change other backends: one run each
            tilelang_decode.NUM_STAGES, tilelang_decode.MIN_Q_ROWS = stages, q_rows
            tilelang_decode.SHORT_CACHE_MAX_BLOCKS = short_max
            tilelang_decode.PRODUCER_REGISTERS = producer_regs
            planner.PROGRAMS_PER_MULTIPROCESSOR = ppsm
            planner.BLOCK_N_CANDIDATES = (block_n,)
            planner.MIN_BLOCKS_PER_SPLIT = min_chunk
            planner.plan.cache_clear()
            row = dict(case=case.number, backend=backend, stages=stages, rows=q_rows, ppsm=ppsm, block_n=block_n,
                       min_chunk=min_chunk, short_max=short_max, producer_regs=producer_regs)
            fn = lambda: flash_decode_with_kvcache(q, k, v, seqlens, backend=backend)
            try:  # a knob combination the compiler rejects is logged, the sweep goes on
                out = fn()
                err = relative_error(out, expected)
                timing, graph_out = timer.time_graph(fn)
            except Exception as error:  # noqa: BLE001
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[-1][:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            err = max(err, relative_error(graph_out, expected))
            us = timing.median_us
            row.update(us=round(us, 2), gbps=round(nbytes / us / 1e3), speedup=round(fa2[case.number] / us, 3),
                       rel_err=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if err < 1e-2 and (case.number not in best or us < best[case.number]["us"]):
                best[case.number] = row
    if args.log:
        with open(args.log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'case':>4} {'backend':>8} {'st':>2} {'rows':>4} {'ppsm':>4} {'bn':>4} {'minc':>4} {'graph us':>8} "
          f"{'GB/s':>6} {'vsFA2':>6}")
    for number, r in sorted(best.items()):
        print(f"{number:>4} {r['backend']:>8} {r['stages']:>2} {r['rows']:>4} {r['ppsm']:>4} {r['block_n']:>4} "
              f"{r['min_chunk']:>4} {r['us']:>8.2f} {r['gbps']:>6} {r['speedup']:>6.2f}")


if __name__ == "__main__":
    main()
