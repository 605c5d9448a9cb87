"""Host time of transformers' attention function per call, per system, in eager decode steps of a
models-bench model: what an eager step's attention costs the host (eager steps of small models are
host-bound, so this, not GPU time, sets their speed).

Each system's attention function is wrapped with a wall clock (no synchronisation: the time to
return, as the model's next op waits for it), over the models-bench's eager steps
(``models.time_systems``: both systems in its interleaved rounds); printed per system with the
step's median ms and a torch launch's host time (an empty tensor's add) beside it.

``--profile N``: also one eager step per row under torch's profiler, its N ops of most host time
(self) printed per system: where a step's host time goes beyond attention.

Usage: python tools/attention_host_time.py [--model smollm2-135m] [--batch 1,64] [--context 1024] [--profile 25]
"""
import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashdecode.bench import models  # noqa: E402
from flashdecode.bench.timing import Timer  # noqa: E402



def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--context", default="1024")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print a profiled step's N costliest ops")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times eager steps on a CUDA device; torch sees none here")
    try:
        models.model_config(args.model)
    except ValueError as error:
        parser.error(f"--model: {error}")
    from transformers import AttentionInterface, AutoModelForCausalLM

    names = models.register_systems()
    interface = AttentionInterface._global_mapping
    spent = {"sdpa": [], "flashdecode": []}  # the model's own sdpa runs from its first step
    for system in ("sdpa", "flashdecode"):
        function = interface[names[system]]

        def timed(*a, _function=function, _system=system, **kw):
            began = time.perf_counter()
            result = _function(*a, **kw)
            spent[_system].append(time.perf_counter() - began)
            return result

        interface[names[system]] = timed
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(models.model_config(args.model), dtype=torch.bfloat16).eval()
    launch = torch.zeros(1, device="cuda")
    print(f"torch launch: {Timer('cuda', iters=1, warmup=1).host_overhead_us(lambda: launch.add_(0)):.1f} us host")
    print("| batch | context | system | attention host us/call | step ms (median) |")
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            step = models.DecodeStep(model, batch, context, models.step_capacity(context))
            for calls in spent.values():
                calls.clear()
            times, errors = models.time_systems(step, "eager", {system: names[system] for system in spent})
            if errors:
                raise next(iter(errors.values()))
            for system in spent:
                print(f"| {batch} | {context} | {system} | {statistics.median(spent[system]) * 1e6:.1f} | "
                      f"{times[system]:.2f} |")
                if args.profile:
                    model.set_attn_implementation(names[system])
                    step.rewind()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                        step()
                    step.rewind()
                    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile))


if __name__ == "__main__":
    main()
