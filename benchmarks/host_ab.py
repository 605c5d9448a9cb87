"""Host time per eager call under several values of one ``Tuning`` field, in one process so that the
host's noise hits every value alike (runs in separate processes differ by more than most changes:
perf log §42, §43).

Each case is planned once per value, with ``DecodeContext(tuning=...)`` (the device's tuning with
FIELD replaced); rounds alternate between the values and one plain torch launch (``q.add_(0)``),
each round ``Timer.host_overhead_us`` over CALLS calls back to back; the table gives the median
round of each and the plan that ran.

Values: ints, or 0/1 for a bool field; for a field that maps backends to values
(``min_blocks_per_combined_split``), the value given to ``--backend``.

Usage (on the GPU machine):
  python benchmarks/host_ab.py --field dependent_combine --values 0,1 --cases 10,13,14
  python benchmarks/host_ab.py --field max_splits_merged_in_split --values 0,16 --cases 4,7,8,9,10,12
  [--backend triton] [--variant plain] [--rounds 9]
"""
import argparse
import dataclasses
import statistics

import torch

from flashdecode import DecodeContext, flash_attn_with_kvcache, plan_for
from flashdecode.bench.timing import Timer
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call
from flashdecode.hardware import Tuning, current

CALLS = 500


def by_backend(value) -> bool:
    """Whether a Tuning value maps backend names to values, as ((name, value), ...)."""
    return isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                                            for pair in value)


#: The fields an A/B can set: ints, bools and values by backend.
FIELDS = [field.name for field in dataclasses.fields(Tuning)
          if isinstance(getattr(Tuning(), field.name), int) or by_backend(getattr(Tuning(), field.name))]


def tuning_value(field: str, text: str, backend: str):
    """``text`` as a value of Tuning's ``field``, typed as the field's default."""
    default = getattr(Tuning(), field)
    if isinstance(default, bool):
        return bool(int(text))
    if by_backend(default):
        return ((backend, int(text)),)
    return int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--field", required=True, choices=FIELDS)
    parser.add_argument("--values", required=True, help="comma list, e.g. 0,1")
    parser.add_argument("--cases", default="10,13,14")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--variant", default="plain")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    timer = Timer(torch.device("cuda"), iters=1, warmup=0, cold_l2=False)
    values = args.values.split(",")
    contexts = {value: DecodeContext("cuda", tuning=dataclasses.replace(
        current().tuning, **{args.field: tuning_value(args.field, value, args.backend)})) for value in values}
    scratch = torch.zeros(1024, device="cuda")
    for number in (int(case) for case in args.cases.split(",")):
        call = make_call(CASES_BY_NUMBER[number], VARIANTS[args.variant], device="cuda")
        kwargs = call.kwargs()
        calls, plans = {}, {}
        for value, context in contexts.items():
            plans[value] = plan_for(call.q, call.k_cache, call.v_cache, **kwargs, backend=args.backend,
                                    context=context).plan
            calls[value] = (lambda context=context: flash_attn_with_kvcache(
                call.q, call.k_cache, call.v_cache, **kwargs, backend=args.backend, context=context))
            timer.host_overhead_us(calls[value], 20)  # compiled, specialised, host path recorded
        rounds = {name: [] for name in ("torch", *values)}
        for _ in range(args.rounds):
            rounds["torch"].append(timer.host_overhead_us(lambda: scratch.add_(0), CALLS))
            for value, fn in calls.items():
                rounds[value].append(timer.host_overhead_us(fn, CALLS))
        cells = [f"torch {statistics.median(rounds['torch']):5.1f}"]
        for value in values:
            plan = plans[value]
            kind = plan.kernel + (" merge" if plan.merge_in_split else "") + (
                " dependent" if plan.dependent_combine else "")
            cells.append(f"{args.field}={value}: {kind} {statistics.median(rounds[value]):5.1f} us")
        print(f"case {number:2d} {args.variant} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
