"""The summary of a `flashdecode bench --json` run for docs/benchmarks.md, computed, not typed.

Prints the markdown table, one row per (case, variant): FA2 (this run's where it ran, else the anchor
file's for the 14 plain cases), our backends' cold median / GPU (graph) time / host time per call /
eager-loop time per call, the best of our two against FA2, the fraction of the ceiling, the best
FlashInfer system, SDPA, flex and TileOPs' GPU time (14 plain cases); then, per variant, wins against
FA2 and geometric means, for TileLang alone and for the faster of our two backends, on medians and
on GPU (graph) time. With ``--plain RUN.json`` (a run holding the plain calls; the run itself if it
does), a second table: each variant's GPU (graph) time over the plain call's, best of our backends
on both sides, per case (issue 13's "within 10% of the contiguous cache"). Last, the headroom: the
geometric mean over FA2 that a system would reach with every case at the in-run ceiling and none
below one torch launch's GPU time (``headroom``), against which a target over FA2 can be read.

Usage: python tools/summary_table.py docs/benchmarks.json [--plain docs/benchmarks.json]
"""
import argparse
import json
import math
import pathlib

from flashdecode.bench.runner import ANCHOR_DEVICE, ANCHOR_PATH, anchor_for

TILEOPS_PATH = ANCHOR_PATH.with_name("h200-tileops.json")  # the packaged copy of the TileOPs anchor

OURS = ("tilelang", "triton")
FLASHINFER = ("flashinfer-tc", "flashinfer-cc", "flashinfer-single")


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def cell(result, key="median_us"):
    return f"{result[key]:.1f}" if result and result.get(key) is not None else "-"


def timings(result):
    """"median / graph / host / eager" of one result, "-" where absent."""
    if not result or result.get("median_us") is None:
        return "skipped" if result and result.get("skipped") else "-"
    return " / ".join(cell(result, key) for key in ("median_us", "graph_us", "host_overhead_us", "eager_us"))


def best_of(results, names):
    """(name, result) of the correct system among ``names`` with the lowest median, or (None, None)."""
    correct = [(name, results[name]) for name in names if results.get(name, {}).get("correct")]
    return min(correct, key=lambda item: item[1]["median_us"], default=(None, None))


def best_graph(results):
    """The lowest correct GPU (graph) time of our backends, or None."""
    graphs = [results[name]["graph_us"] for name in OURS
              if results.get(name, {}).get("correct") and results[name].get("graph_us") is not None]
    return min(graphs, default=None)


def headroom(run, fractions=(1.0, 0.9)):
    """{fraction: geometric mean over FA2's GPU (graph) time} for a system whose every plain case
    reads its bytes at ``fraction`` of the in-run ceiling and takes no less than the GPU time of one
    plain torch launch (the floor of a one-kernel call, ``torch_launch_gpu_us``), over the plain
    cases where FA2 was timed in the run; {} where the run lacks FA2 or that floor. Nothing reaches
    a fraction of 1.0, so the first value bounds every system's geometric mean in that run."""
    floor, ceiling = run["settings"].get("torch_launch_gpu_us"), run["ceiling"]["gbps"] * 1e3  # bytes / us
    fa2 = [(case["bytes"], case["results"]["fa2"]["graph_us"]) for case in run["cases"]
           if case.get("variant", "plain") == "plain" and case["results"].get("fa2", {}).get("correct")
           and case["results"]["fa2"].get("graph_us")]
    if floor is None or not fa2:
        return {}
    return {fraction: geomean([graph / max(size / (fraction * ceiling), floor) for size, graph in fa2])
            for fraction in fractions}


def check_same_device(run, plain_run):
    """ValueError unless both runs are one device's: a GPU time over another GPU's is no ratio."""
    if plain_run["device"] != run["device"]:
        raise ValueError(f"--plain: its run is an {plain_run['device']}'s and this one an {run['device']}'s; GPU "
                         f"times compare on one device")


def print_against_plain(run, plain_run):
    """Each variant's best GPU time over the plain call's, per case (markdown); nothing for a run
    without variants."""
    plain = {str(c["case"]): best_graph(c["results"]) for c in plain_run["cases"] if c.get("variant", "plain") == "plain"}
    variants = [name for name in run["settings"].get("variants", ["plain"]) if name != "plain"]
    if not variants:
        return
    table = {}
    for case in run["cases"]:
        label, variant = str(case["case"]), case.get("variant", "plain")
        if variant in variants and plain.get(label):
            graph = best_graph(case["results"])
            table.setdefault(label, {})[variant] = f"{graph / plain[label]:.2f}" if graph else "-"
    print()
    print("Best GPU (graph) time of each variant over the plain call's (best of our backends on both sides):")
    print()
    print("| case | plain µs | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for label, row in table.items():
        print(f"| {label} | {plain[label]:.1f} | " + " | ".join(row.get(name, "-") for name in variants) + " |")


def print_host_ratios(run, limit=1.5):
    """Per backend: host time per call over the plain torch launch timed in loops alternating with
    it (``host_launch_us``; runs before it have none), the largest and the cases above ``limit``."""
    for name in OURS:
        ratios = [(str(case["case"]) + ("" if case.get("variant", "plain") == "plain" else "/" + case["variant"]),
                   result["host_overhead_us"] / result["host_launch_us"])
                  for case in run["cases"] for result in [case["results"].get(name, {})]
                  if result.get("host_launch_us") and result.get("host_overhead_us") is not None]
        if ratios:
            over = [f"{label} ({ratio:.2f}×)" for label, ratio in ratios if ratio > limit]
            print(f"{name}: host time over a torch launch timed alongside: {min(r for _, r in ratios):.2f}-"
                  f"{max(r for _, r in ratios):.2f}×; above {limit}×: {', '.join(over) or 'none'}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=pathlib.Path)
    parser.add_argument("--plain", type=pathlib.Path, default=None,
                        help="a run with the plain calls: adds each variant's GPU time over the plain call's")
    args = parser.parse_args()
    run = json.loads(args.run.read_text())
    plain_run = json.loads(args.plain.read_text()) if args.plain else None
    if plain_run is not None:
        try:
            check_same_device(run, plain_run)
        except ValueError as error:
            parser.error(str(error))
    # TileOPs' times, like the FA2 anchor's, were measured on the H200: no comparison on another GPU
    anchor = anchor_for(run["device"])
    anchor_graph = {str(c["case"]): c["fa2"]["graph_us"] for c in anchor["cases"]} if anchor else {}
    tileops = ({str(c["case"]): c["gpu_us"] for c in json.loads(TILEOPS_PATH.read_text())["cases"]}
               if anchor else {})
    ceiling = run["ceiling"]["gbps"]
    launch = run["settings"].get("torch_launch_us")
    print(f"Times in us: median (cold L2) / GPU (graph) / host per call / eager loop per call. One plain torch "
          f"launch: {launch:.1f} us of host time." if launch is not None else "Times in us.")
    print()
    print("| case | variant | batch, seqlen_cache, Hk, G, D | FA2 | TileLang | Triton | best ×FA2 | TileLang ×FA2 "
          "| of ceiling | FlashInfer (best) | SDPA | flex | TileOPs GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    speedups = {}  # (variant, "medians" | "GPU (graph) time", "tilelang" | "best") -> [x FA2]
    slower_than_tileops = []
    for case in run["cases"]:
        label, variant, shape, results = str(case["case"]), case.get("variant", "plain"), case["shape"], case["results"]
        fa2, system = case["baseline_us"], case.get("baseline_system")
        fa2_source = "" if system == "fa2" else " (file)" if system is None else f" ({system})"
        fa2_run = results.get("fa2", {})
        fa2_graph = fa2_run.get("graph_us") if fa2_run.get("correct") else (
            anchor_graph.get(label) if variant == "plain" else None)
        best_name, best = best_of(results, OURS)
        tl = results.get("tilelang", {})
        fastest = best_graph(results)
        if fa2 is not None and best is not None:
            pairs = (("medians", "best", fa2 / best["median_us"]),
                     ("medians", "tilelang", fa2 / tl["median_us"] if tl.get("correct") else None),
                     ("GPU (graph) time", "best", fa2_graph / fastest if fa2_graph and fastest else None),
                     ("GPU (graph) time", "tilelang",
                      fa2_graph / tl["graph_us"] if fa2_graph and tl.get("correct") and tl.get("graph_us") else None))
            for measure, who, value in pairs:
                if value is not None:
                    speedups.setdefault((variant, measure, who), []).append(value)
        if variant == "plain" and label in tileops and fastest and fastest > tileops[label]:
            slower_than_tileops.append(f"{label} ({fastest:.1f} vs {tileops[label]:.1f})")
        fi_name, fi = best_of(results, FLASHINFER)
        shape_text = (f"{shape['batch']}, {shape['seqlen_cache']}, {shape['nheads_k']}, {shape['group']}, "
                      f"{shape.get('headdim', 128)}")
        best_text = f"**{fa2 / best['median_us']:.2f}×** ({best_name})" if fa2 and best else "-"
        tl_text = f"{fa2 / tl['median_us']:.2f}×" if fa2 and tl.get("correct") else "-"
        fraction = f"{best['bandwidth_gbps'] / ceiling:.2f}" if best else "-"
        fa2_text = "-" if fa2 is None else f"{fa2:.2f}{fa2_source}"
        print(f"| {label} | {variant} | {shape_text} | {fa2_text} | {timings(tl)} | {timings(results.get('triton'))} "
              f"| {best_text} | {tl_text} | {fraction} | {timings(fi)}{f' ({fi_name})' if fi_name else ''} "
              f"| {cell(results.get('sdpa'))} / {cell(results.get('sdpa'), 'graph_us')} "
              f"| {cell(results.get('flex'))} / {cell(results.get('flex'), 'graph_us')} "
              f"| {tileops.get(label, '-') if variant == 'plain' else '-'} |")
    print()
    for (variant, measure, who), values in speedups.items():
        wins = sum(v > 1 for v in values)
        print(f"{variant}, {measure}, {who}: faster than FA2 on {wins} of {len(values)}, "
              f"geometric mean {geomean(values):.2f}x")
    if tileops:
        print("faster backend's GPU time slower than TileOPs on cases:", ", ".join(slower_than_tileops) or "none")
    else:
        print(f"TileOPs: not compared (its times are an {ANCHOR_DEVICE}'s)")
    print_host_ratios(run)
    bounds = headroom(run)
    if bounds:
        print("headroom: plain cases at " + ", ".join(f"{fraction:.0%} of the ceiling give {value:.2f}x"
                                                      for fraction, value in bounds.items())
              + " over FA2 (GPU time; no case below one torch launch's GPU time, "
              f"{run['settings']['torch_launch_gpu_us']:.2f} us)")
    if plain_run is not None:
        print_against_plain(run, plain_run)


if __name__ == "__main__":
    main()
