"""Host time per eager call of Triton's split plans with the merge in the split kernel (one launch)
against the combine kernel (two launches), in one process so the host's noise hits both alike.

Each case is planned twice, with ``Tuning.max_splits_merged_in_split`` 0 (never merge) and the
device's value; rounds alternate between them and one plain torch launch (``q.add_(0)``), each round
``Timer.host_overhead_us`` over CALLS calls back to back; the table gives the median round.

Usage (on the GPU machine): python benchmarks/host_merge_ab.py [--cases 4,7,8,9,10,12] [--rounds 9]
"""
import argparse
import dataclasses
import statistics

import torch

from flashdecode import DecodeContext, flash_attn_with_kvcache, plan_for
from flashdecode.bench.timing import Timer
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call
from flashdecode.hardware import current

CALLS = 500


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="4,7,8,9,10,12")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    timer = Timer(torch.device("cuda"), iters=1, warmup=0, cold_l2=False)
    tuning = current().tuning
    thresholds = (0, tuning.max_splits_merged_in_split)
    contexts = {threshold: DecodeContext("cuda", tuning=dataclasses.replace(tuning, max_splits_merged_in_split=threshold))
                for threshold in thresholds}
    scratch = torch.zeros(1024, device="cuda")
    for number in (int(case) for case in args.cases.split(",")):
        call = make_call(CASES_BY_NUMBER[number], VARIANTS["plain"], device="cuda")
        kwargs = call.kwargs()
        calls, plans = {}, {}
        for threshold, context in contexts.items():
            plans[threshold] = plan_for(call.q, call.k_cache, call.v_cache, **kwargs, backend="triton",
                                        context=context).plan
            calls[threshold] = (lambda context=context: flash_attn_with_kvcache(
                call.q, call.k_cache, call.v_cache, **kwargs, backend="triton", context=context))
            timer.host_overhead_us(calls[threshold], 20)  # compiled, specialised, host path cached
        rounds = {name: [] for name in ("torch", *thresholds)}
        for _ in range(args.rounds):
            rounds["torch"].append(timer.host_overhead_us(lambda: scratch.add_(0), CALLS))
            for threshold, fn in calls.items():
                rounds[threshold].append(timer.host_overhead_us(fn, CALLS))
        cells = [f"torch {statistics.median(rounds['torch']):5.1f}"]
        for threshold in thresholds:
            plan = plans[threshold]
            kind = plan.kernel + (" merge" if plan.merge_in_split else "")
            cells.append(f"threshold {threshold}: {kind} {statistics.median(rounds[threshold]):5.1f} us")
        print(f"case {number:2d} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
