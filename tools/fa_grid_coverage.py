"""How much of FlashAttention's grid has passed on the GPU: distinct combos per backend and outcome,
and passes per feature value, from the pytest logs of GPU runs (``tools/device.sh tests``).

Logs are read in the order given; a combo's last outcome counts (a later run's pass replaces an
earlier run's out-of-memory failure). Features are the grid's ``axis=value`` keys. The logs are
pytest's own (``$OUT/gpu_tests.log`` of a call): the ones under ``docs/data/`` keep only the verdict
counts per file and the last lines, which say too little here (a log that yields fewer verdicts
than its counts is named on stderr).

Usage: python tools/fa_grid_coverage.py GPU_TESTS_LOG [GPU_TESTS_LOG ...]
"""
import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import fa_grid  # noqa: E402 - the grid's definition lives with its tests


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args()
    outcomes = {}
    for path in map(pathlib.Path, args.logs):
        if not path.is_file():
            parser.error(f"no log at {path}")
        text = path.read_text(errors="replace")
        found = fa_grid.log_outcomes(text, {})
        counted = sum(int(count) for count in re.findall(r"^\s*(\d+) tests/test_fa_kvcache\.py \w+$", text, re.M))
        if counted > len(found):  # tools/device.sh's per-file counts: the verdict lines themselves are gone
            print(f"{path}: {len(found)} verdicts read, {counted} counted: a condensed log", file=sys.stderr)
        outcomes.update(found)
    report = fa_grid.coverage(outcomes).get("gpu", {})
    if not report:
        print("no verdicts of the grid's GPU tests in these logs", file=sys.stderr)
        return 1
    grid = fa_grid.full_grid()
    distinct = len({combo.id for combo in grid})  # axes that do not apply share an id
    for backend, dtypes in report.items():
        totals, features = {}, {}
        for entry in dtypes.values():
            for outcome, count in entry["total"].items():
                totals[outcome] = totals.get(outcome, 0) + count
            for feature, counts in entry["features"].items():
                into = features.setdefault(feature, {})
                for outcome, count in counts.items():
                    into[outcome] = into.get(outcome, 0) + count
        print(f"{backend}: " + ", ".join(f"{outcome} {count}" for outcome, count in sorted(totals.items()))
              + f" of {distinct} distinct combos ({len(grid)} parameter combinations)")
        print("| feature | pass | fail | skip |\n|---|---|---|---|")
        for feature, counts in features.items():
            print(f"| {feature} | {counts.get('pass', 0)} | {counts.get('fail', 0)} | {counts.get('skip', 0)} |")


if __name__ == "__main__":
    sys.exit(main())
