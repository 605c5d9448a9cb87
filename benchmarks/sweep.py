"""Tuning sweep on the GPU: time a backend on the matrix cases over planner knobs.

Times with triton.testing.do_bench (cold L2: it zeroes a 256 MB buffer before every run; median),
the method of flashdecode/data/h200-peers.json, and checks every variant against the reference in
the same run. Usage: python benchmarks/sweep.py --backend triton --ppsm 2,4,8 --block-n 32,64
Prints one line per (case, variant) and a best-per-case table last; --log PATH keeps the lines.
"""
import argparse
import itertools
import json

import torch
import triton.testing

from flashdecode import flash_decode_with_kvcache, planner
from flashdecode.cases import CASES, bytes_read, make_inputs
from flashdecode.reference import reference_decode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--ppsm", default=str(planner.PROGRAMS_PER_MULTIPROCESSOR))
    parser.add_argument("--block-n", default=",".join(map(str, planner.BLOCK_N_CANDIDATES[:1])))
    parser.add_argument("--cases", default="")
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    numbers = [int(c) for c in args.cases.split(",")] if args.cases else [c.number for c in CASES]
    fa2 = {c["case"]: c["fa2"]["median_us"] for c in json.load(open("flashdecode/data/h200-peers.json"))["cases"]}
    rows, best = [], {}
    for case in (c for c in CASES if c.number in numbers):
        q, k, v, seqlens = make_inputs(case, device="cuda")
        expected, _ = reference_decode(q, k, v, seqlens)
        nbytes = bytes_read(seqlens.tolist(), case.nheads_k, case.nheads)
        for ppsm, block_n in itertools.product(map(int, args.ppsm.split(",")), map(int, args.block_n.split(","))):
            planner.PROGRAMS_PER_MULTIPROCESSOR = ppsm
            planner.BLOCK_N_CANDIDATES = (block_n,)
            planner.plan.cache_clear()
            fn = lambda: flash_decode_with_kvcache(q, k, v, seqlens, backend=args.backend)
            out = fn()
            err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            row = dict(case=case.number, ppsm=ppsm, block_n=block_n, us=round(us, 2),
                       gbps=round(nbytes / us / 1e3), speedup=round(fa2[case.number] / us, 3), rel_err=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if err < 1e-2 and (case.number not in best or us < best[case.number]["us"]):
                best[case.number] = row
    if args.log:
        with open(args.log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'case':>4} {'ppsm':>4} {'bn':>4} {'us':>8} {'GB/s':>6} {'vsFA2':>6}")
    for number, r in sorted(best.items()):
        print(f"{number:>4} {r['ppsm']:>4} {r['block_n']:>4} {r['us']:>8.2f} {r['gbps']:>6} {r['speedup']:>6.2f}")


if __name__ == "__main__":
    main()
