"""Run FlashAttention's kvcache grid combos one by one, synchronizing after each, and print each
id before it runs: under compute-sanitizer or after an illegal access, the last id printed is the
culprit (the pytest grid cannot say which test's kernel faulted once the context is dead).

    python tools/fa_combos.py --backend triton float16-q64k800-d32-gqa-splits1-newkv-... [ID ...]
    python tools/fa_combos.py --backend triton --sample 40 --seed 2025
    python tools/fa_combos.py --repeat 50 --value-checks bfloat16-q64k256-d59-gqa-splits0-alibi-causal-page256

``--repeat`` runs each combo that many times on the same inputs (a race shows on some runs only);
``--value-checks`` turns on the host checks (``flashdecode.set_value_checks``), which also find
ticket counters an earlier merging split kernel left above zero. ``--diagnose`` prints, for each
combo, its drawn lengths and plan and, for its own split count and 1, 2 and 3 splits (on a GPU under
Triton also its plan without the register cap, with the splits merged by the combine kernel, and
first, where its plan reads an fp8 V as words, with the cast instead),
the output's and lse's largest errors against the oracle and where the lse is off (sequence, head,
query row).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import fa_grid  # noqa: E402

import flashdecode  # noqa: E402
from flashdecode.context import DecodeContext  # noqa: E402
from flashdecode.hardware import current  # noqa: E402
from flashdecode.kernels.base import BackendError  # noqa: E402
from flashdecode.kernels.triton.backend import fp8_v_words  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="combo ids as the grid test names them (without the backend)")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--sample", type=int, default=0, help="also run this many sampled combos")
    parser.add_argument("--seed", type=int, default=2025)
    parser.add_argument("--dtype", action="append", help="with ids: also run each id in these dtypes")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each combo")
    parser.add_argument("--value-checks", action="store_true", help="check index values and counters on the host")
    parser.add_argument("--diagnose", action="store_true", help="errors by split count and the rows that are off")
    args = parser.parse_args(argv)
    flashdecode.set_value_checks(args.value_checks)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wanted = set(args.ids)
    for dtype in args.dtype or ():
        wanted |= {f"{dtype}-{i.split('-', 1)[1]}" for i in args.ids}
    combos = []
    for wanted_id in sorted(wanted):
        try:
            combo = fa_grid.Combo.from_id(wanted_id)
        except (ValueError, IndexError) as error:
            parser.error(f"not a grid id: {wanted_id} ({error})")
        why = "it reads back as " + combo.id if combo.id != wanted_id else fa_grid.skip_reason(combo)
        if why:
            parser.error(f"not in the grid: {wanted_id} ({why})")
        combos.append(combo)
    combos += fa_grid.sample(args.sample, seed=args.seed) if args.sample else []
    failed = 0

    def call(**arguments):
        return flashdecode.flash_attn_with_kvcache(**arguments, backend=args.backend)

    if args.diagnose:
        for combo in combos:
            diagnose(combo, device, args.backend)
        return 0
    for combo in (combo for combo in combos for _ in range(args.repeat)):
        print(f"RUN  {combo.id}", flush=True)
        started = time.perf_counter()
        try:
            fa_grid.check_combo(combo, device, call)
            if device == "cuda":
                torch.cuda.synchronize()
            verdict = "ok"
        except BackendError as error:
            verdict = f"skip ({error})"
        except AssertionError as error:
            failed += 1
            verdict = f"FAIL {str(error).splitlines()[0][:160]}"
        except ValueError as error:  # a value check
            failed += 1
            verdict = f"FAIL {type(error).__name__}: {str(error)[:160]}"
        except RuntimeError as error:  # counters left above zero (reset by the check), else a fault
            if not str(error).startswith("tickets:"):
                raise
            failed += 1
            verdict = f"FAIL {str(error)[:160]}"
        print(f"     {verdict} {time.perf_counter() - started:.1f}s", flush=True)
    print(f"{len(combos)} combos x {args.repeat} runs, {failed} failed")
    return 1 if failed else 0


def diagnose(combo, device, backend):
    """The combo's lengths and plan, then for each split count its errors (``--diagnose``)."""
    case = fa_grid.make_case(combo, device)
    call = case.call
    print(f"{combo.id}: cache_seqlens {call['cache_seqlens'].tolist()}", flush=True)
    plan = flashdecode.plan_for(**{k: v for k, v in call.items() if k != 'return_softmax_lse'}, backend=backend).plan
    print(f"  {plan}")
    keys = ~torch.isneginf(case.lse_ref)
    runs = [(f"splits={splits}", {"num_splits": splits}) for splits in sorted({combo.num_splits, 1, 2, 3})]
    if backend == "triton" and device == "cuda":  # the combo's own plan without what only the GPU runs
        tuning = current().tuning
        runs += [("no register cap", {"context": DecodeContext(
                     "cuda", config=dataclasses.replace(plan.config, max_registers=None))}),
                 ("merged by its own kernel", {"context": DecodeContext(
                     "cuda", tuning=dataclasses.replace(tuning, max_splits_merged_in_split=0))})]
        if fp8_v_words(plan.config, fa_grid.problem_of(combo)):  # first: a words kernel may fault
            runs.insert(0, ("fp8 V cast, not words", {"context": DecodeContext(
                "cuda", config=dataclasses.replace(plan.config, fp8_v_words=False))}))
    for label, changes in runs:
        out, lse = flashdecode.flash_attn_with_kvcache(**{**call, **changes}, backend=backend)
        error = torch.where(keys, (lse - case.lse_ref).abs(), torch.zeros_like(lse))
        off = (error > 0.01).nonzero().tolist()  # (sequence, head, query row)
        print(f"  {label}: out error {(out.float() - case.out_ref.float()).abs().max().item():.3g}, "
              f"lse error {error.max().item():.3g}, -inf rows alike {torch.equal(torch.isneginf(lse), ~keys)}, "
              f"{len(off)} lse rows off by > 0.01", flush=True)
        if off:
            print(f"    per sequence {[sum(1 for row in off if row[0] == b) for b in range(lse.shape[0])]}, "
                  f"heads {sorted({row[1] for row in off})}, query rows {sorted({row[2] for row in off})[:24]}")
            b, h, r = off[0]
            print(f"    first: ours {lse[b, h, r].item():.4f}, oracle {case.lse_ref[b, h, r].item():.4f}, "
                  f"PyTorch's {case.lse_pt[b, h, r].item():.4f}")


if __name__ == "__main__":
    sys.exit(main())
