"""How much of FlashAttention's grid has passed on the GPU: distinct combos per backend and outcome,
and passes per feature value, from the pytest logs of GPU runs (``tools/device.sh tests``).

Logs are read in the order given; a combo's last outcome counts (a later run's pass replaces an
earlier run's out-of-memory failure). Features are the grid's ``axis=value`` keys.

Usage: python tools/fa_grid_coverage.py docs/data/2026-12-01-s1[345]-gpu-tests-fa-grid.log
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import fa_grid  # noqa: E402 - the grid's definition lives with its tests


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args()
    outcomes = {}
    for path in args.logs:
        fa_grid.log_outcomes(pathlib.Path(path).read_text(errors="replace"), outcomes)
    report = fa_grid.coverage(outcomes).get("gpu", {})
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
    main()
