"""The summary of a `flashdecode bench --json` run for docs/benchmarks.md, computed, not typed.

Prints the markdown table (medians / graph times, FA2 from the anchor file, TileOPs' GPU time) and
the figures the text quotes: wins against FA2 and geometric means, for TileLang alone and for the
faster of our two backends, on medians and on GPU (graph) time.

Usage: python benchmarks/summary_table.py docs/benchmarks.json
"""
import argparse
import json
import math
import pathlib

from flashdecode.bench.runner import ANCHOR_PATH

TILEOPS_PATH = ANCHOR_PATH.with_name("h200-tileops.json")  # the packaged copy of the TileOPs anchor

OURS = ("tilelang", "triton")


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values))


def cell(result, key="median_us"):
    return f"{result[key]:.1f}" if result and result.get(key) is not None else "-"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=pathlib.Path)
    args = parser.parse_args()
    run = json.loads(args.run.read_text())
    fa2_graph = {c["case"]: c["fa2"]["graph_us"] for c in json.loads(ANCHOR_PATH.read_text())["cases"]}
    tileops = {c["case"]: c["gpu_us"] for c in json.loads(TILEOPS_PATH.read_text())["cases"]}
    ceiling = run["ceiling"]["gbps"]
    print("| case | batch, seqlen_cache, Hk, G | FA2 (file) | TileLang | Triton | best ×FA2 | TileLang ×FA2 "
          "| of ceiling | SDPA | flex | TileOPs GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    median_speedups = {"tilelang": [], "best": []}
    graph_speedups = {"tilelang": [], "best": []}
    slower_than_tileops = []
    for case in run["cases"]:
        number, shape, results = case["case"], case["shape"], case["results"]
        fa2 = case["baseline_us"]
        best = min((results[name] for name in OURS if results.get(name, {}).get("correct")),
                   key=lambda r: r["median_us"])
        best_graph = min(results[name]["graph_us"] for name in OURS if results.get(name, {}).get("correct"))
        tl = results["tilelang"]
        median_speedups["tilelang"].append(fa2 / tl["median_us"])
        median_speedups["best"].append(fa2 / best["median_us"])
        graph_speedups["tilelang"].append(fa2_graph[number] / tl["graph_us"])
        graph_speedups["best"].append(fa2_graph[number] / best_graph)
        if number in tileops and best_graph > tileops[number]:
            slower_than_tileops.append(f"{number} ({best_graph:.1f} vs {tileops[number]:.1f})")
        shape_text = f"{shape['batch']}, {shape['seqlen_cache']}, {shape['nheads_k']}, {shape['group']}"
        print(f"| {number} | {shape_text} | {fa2:.2f} | {cell(tl)} / {cell(tl, 'graph_us')} "
              f"| {cell(results.get('triton'))} / {cell(results.get('triton'), 'graph_us')} "
              f"| **{fa2 / best['median_us']:.2f}×** | {fa2 / tl['median_us']:.2f}× "
              f"| {best['bandwidth_gbps'] / ceiling:.2f} "
              f"| {cell(results.get('sdpa'))} / {cell(results.get('sdpa'), 'graph_us')} "
              f"| {cell(results.get('flex'))} / {cell(results.get('flex'), 'graph_us')} "
              f"| {tileops.get(number, '-')} |")
    print()
    for label, speedups in (("medians", median_speedups), ("GPU (graph) time", graph_speedups)):
        for who in ("tilelang", "best"):
            values = speedups[who]
            wins = sum(v > 1 for v in values)
            print(f"{label}, {who}: faster than FA2 on {wins} of {len(values)}, geometric mean {geomean(values):.2f}x")
    print("faster backend's GPU time slower than TileOPs on cases:", ", ".join(slower_than_tileops) or "none")


if __name__ == "__main__":
    main()
