"""Graph replay against the cold eager median of one backend, on the bench's own inputs (GPU machine).

The bench times a case's cold medians and then its graph replays (``runner.measure``); a graph
figure above the cold median is an extra cost in the captured call (session 19: the memset of a
merging call's counters, perf log §47), a transient of the case's first replays (§56) or noise.
This measures one backend three times in a row on a case's inputs and the other layers'
(``runner.case_inputs``, as the bench sets them up), then its graph alone, so the two can be told
apart; ``--graph-first N`` times N graphs alone before them, each captured once,
to tell a first graph's cost from a first measurement's; ``--series N`` prints the first of them
as medians of N runs at a time over ``--series-runs`` runs in a row, to see when its excess ends.
Usage: python benchmarks/graph_probe.py [--backend triton] [--graph-first N [--series 25]]
--shapes 4x1024x8x4x128:uniform,...
"""
import argparse

import numpy as np
import torch

from flashdecode import cases
from flashdecode.bench import runner
from flashdecode.bench.timing import Timer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--shapes", required=True, help="as bench --shapes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graph-first", type=int, default=0, help="graphs timed alone before the repeats")
    parser.add_argument("--series", type=int, default=0, help="runs a median of the first graph's series covers")
    parser.add_argument("--series-runs", type=int, default=400)
    args = parser.parse_args()
    selection = runner.select(runner.Options(cases=cases.parse_shapes(args.shapes), backends=(args.backend,), peers=(),
                                             iters=50))
    timer = Timer(torch.device("cuda"), selection.iters, selection.warmup, cold_l2=selection.cold_l2)
    series_timer = Timer(torch.device("cuda"), args.series_runs, 0, cold_l2=selection.cold_l2)
    system = selection.systems[0]
    for case in selection.cases:
        _, layers, fresh, references = runner.case_inputs(case, cases.VARIANTS["plain"], selection, timer.device)
        rows = []
        if args.graph_first:
            call = system.setup(layers[:1])[0]
            call()  # compiles, so that nothing compiles during the capture
            timer.synchronize()
            if args.series:
                graph, _ = series_timer.capture(call)
                runs = series_timer.samples(graph.replay)
                medians = [float(np.median(runs[i:i + args.series])) for i in range(0, len(runs), args.series)]
                rows.append(f"first graph by {args.series} runs " + " ".join(f"{m:.2f}" for m in medians))
                del graph
            firsts = [timer.time_graph(call) for _ in range(args.graph_first)]
            rows.append("graphs first " + " ".join("-" if first is None else f"{first[0].median_us:.2f}"
                                                  for first in firsts))
        for _ in range(args.repeats):
            result = runner.measure([system], layers, fresh, references, timer, selection)[0]
            if result.graph is None:
                rows.append(result.error or result.skipped or "no graph")
                break
            rows.append(f"{result.timing.median_us:.2f}/{result.graph.median_us:.2f}")
        alone = timer.time_graph(system.setup(layers[:1])[0])
        print(case.label, case.describe(), "layers", len(layers), f"cold/graph x{args.repeats}:", " ".join(rows),
              "graph only", "-" if alone is None else f"{alone[0].median_us:.2f}")
        del layers


if __name__ == "__main__":
    main()
