"""Make one producer warp of TileLang's split kernel lag, and see whether the kernel still ends.

The hang of perf log 16 has a candidate cause (perf log 18): TileLang 0.1.15 runs the
warp-specialised producer loop on all four warps of the producer warpgroup, and warps 1-3 only
watch the "stage free" barriers. A watcher two phases behind waits forever. This script builds
case 12's split kernel with a ~1 ms sleep injected into warps 1-3 at the producer loop's first
iteration, which puts them many phases behind, in one of two forms:

  --variant four-warps  the producer loop as TileLang emits it (every producer warp runs it)
  --variant one-warp    the shipped rewrite (``decode.one_warp_producer``): warps 1-3 skip it

It then makes ``--calls`` calls (split and combine kernels) and compares the result with the
reference. A watchdog exits with code 3 when a synchronisation takes longer than ``--timeout``
seconds (a hang); 0 means every call ended and the result was right, 1 a wrong result.

Usage (GPU): python benchmarks/producer_lag_check.py --variant four-warps
"""
import argparse
import os
import threading

import torch

import tilelang_case
from flashdecode.kernels.tilelang import decode
from flashdecode.reference import reference_decode, relative_error

HANG_EXIT_CODE = 3
#: Injected at the top of the producer loop: warps 1-3 sleep ~1 ms in their first iteration, long
#: enough for warp 0 and the consumers to get through a whole program of case 12.
LAG = ("if (((int)threadIdx.x) >= 32 && kb == blk_lo) { for (int z = 0; z < 20; ++z) __nanosleep(50000); }\n")
LOOP_BODY = "++kb) {\n"


def inject_lag(code: str) -> str:
    at = code.index(LOOP_BODY) + len(LOOP_BODY)  # the first loop with kb is the producer's
    return code[:at] + LAG + code[at:]


def build(variant, problem, plan, profile):
    rows = decode.q_tile_rows(problem.group, decode.MIN_Q_ROWS)
    blocks_per_sm = decode.resident_programs(problem.headdim, plan.block_n, rows, decode.NUM_STAGES,
                                             profile.registers_per_multiprocessor,
                                             profile.shared_memory_per_multiprocessor)
    func = decode.split_kernel_func("bfloat16", problem.headdim, problem.group, problem.nheads_k, plan.block_n,
                                    decode.NUM_STAGES, plan.can_split, blocks_per_sm, rows,
                                    decode.split_kernel_registers(blocks_per_sm, profile.registers_per_multiprocessor))
    # The flags name the variant: TileLang's cache key has the flags but not the rewrite.
    flags = [f"-DFLASHDECODE_LAG_CHECK={variant.replace('-', '_')}"]
    if variant == "one-warp":
        rewrite = lambda code: inject_lag(decode.one_warp_producer(code))  # noqa: E731
        flags.append(f"-D{decode._PRODUCER_LOOP_MACRO}={decode.PRODUCER_LOOP_THREADS}")
    else:
        rewrite = inject_lag
    with decode._cuda_postproc(rewrite, decode._SPLIT_KERNEL_NAME):
        kernel = decode._compile(func, decode._freeze(decode.device_target()), flags)
    assert "__nanosleep(50000)" in kernel.get_kernel_source()
    return decode._launcher(kernel)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=("four-warps", "one-warp"), required=True)
    parser.add_argument("--case", type=int, default=12)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=20)
    args = parser.parse_args()
    call = tilelang_case.split_call(args.case)
    split = build(args.variant, call.problem, call.plan, call.profile)
    _, combine = decode.launchers_for(call.problem, call.plan, call.profile)

    def watchdog(done: threading.Event):
        if not done.wait(args.timeout):
            print(f"HANG: {args.variant}: no synchronisation within {args.timeout} s", flush=True)
            os._exit(HANG_EXIT_CODE)

    done = threading.Event()
    threading.Thread(target=watchdog, args=(done,), daemon=True).start()
    for _ in range(args.calls):
        split(*call.split_args())
        combine(*call.combine_args())
    torch.cuda.synchronize()
    done.set()
    error = relative_error(call.out, reference_decode(call.q, call.k, call.v, call.seqlens)[0])
    print(f"{args.variant}: {args.calls} calls ended, plan {call.plan}, rel. L2 error {error:.2e}", flush=True)
    raise SystemExit(0 if error < 1e-2 else 1)


if __name__ == "__main__":
    main()
