"""Tuning sweep on the GPU machine: each case under every combination of the given tuning values
and tile configs, timed from a CUDA graph (cold L2) and checked against the reference.

Variants are values given to a ``DecodeContext(tuning=..., config=...)``; nothing is reassigned.
Usage: python benchmarks/sweep.py --backend tilelang,triton --ppsm 2,3,4 --block-n 32,64
       [--tl-stages 2,3 --tl-rows 64,16 --tl-producer-regs 24,0] [--cases 7,12] [--variant plain,paged256]
       [--log FILE]
"""
import argparse
import dataclasses
import itertools
import json

import torch

from flashdecode import DecodeContext, flash_attn_with_kvcache, plan_for
from flashdecode.bench.timing import Timer
from flashdecode.cases import CASES, VARIANTS, make_call
from flashdecode.hardware import current
from flashdecode.reference import reference_attention, relative_error


def values(text):
    return [int(item) for item in text.split(",")] if text else [None]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="tilelang")
    for flag in ("--ppsm", "--min-chunk", "--short-max-blocks", "--block-n", "--tl-stages", "--tl-rows",
                 "--tl-producer-regs"):
        parser.add_argument(flag, default="", help="comma list (default: the measured value)")
    parser.add_argument("--cases", default="")
    parser.add_argument("--variant", default="plain", help="comma list of cases.VARIANTS (default: plain)")
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    numbers = [int(c) for c in args.cases.split(",")] if args.cases else [c.number for c in CASES]
    timer = Timer(torch.device("cuda"), iters=50, warmup=5)
    base = current().tuning
    rows = []
    for case, variant in itertools.product((c for c in CASES if c.number in numbers), args.variant.split(",")):
        inputs = make_call(case, VARIANTS[variant], device="cuda")
        expected = reference_attention(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs())[0]
        nbytes = inputs.bytes_moved()
        for backend, ppsm, min_chunk, short_max, block_n, stages, q_rows, producer in itertools.product(
                args.backend.split(","), *(values(getattr(args, name)) for name in (
                    "ppsm", "min_chunk", "short_max_blocks", "block_n", "tl_stages", "tl_rows", "tl_producer_regs"))):
            tuning = dataclasses.replace(base, **{name: value for name, value in (
                ("programs_per_multiprocessor", ppsm), ("min_blocks_per_split", min_chunk),
                ("short_cache_max_blocks", short_max)) if value is not None})
            default = plan_for(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs(), backend=backend,
                               context=DecodeContext("cuda", tuning=tuning)).plan.config
            changes = {name: value for name, value in (("block_n", block_n), ("num_stages", stages),
                                                       ("block_m", q_rows), ("producer_registers", producer))
                       if value is not None and hasattr(default, name)}
            row = dict(case=case.number, variant=variant, backend=backend, tuning=dataclasses.asdict(tuning), config=changes)
            try:  # a combination the compiler rejects is logged, the sweep goes on
                context = DecodeContext("cuda", tuning=tuning, config=dataclasses.replace(default, **changes))

                def call():
                    return flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs(),
                                                   backend=backend, context=context)

                error = relative_error(call(), expected)
                timing, graph_out = timer.time_graph(call)
                error = max(error, relative_error(graph_out, expected))
                row.update(us=round(timing.median_us, 2), gbps=round(nbytes / timing.median_us / 1e3), rel_err=error)
            except Exception as failure:  # noqa: BLE001
                row["error"] = f"{type(failure).__name__}: {str(failure).splitlines()[-1][:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.log:
        with open(args.log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
