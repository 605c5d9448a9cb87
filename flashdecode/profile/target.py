"""The program Nsight Compute profiles: ``python -m flashdecode.profile.target --case LABEL [--variant V]
--backend B`` (or the shape flags, as ``flashdecode profile`` takes them).

It builds the call's inputs as the benchmark does, runs the call ``--warmup`` times (compilation,
caches, allocator) and then ``--calls`` times between cudaProfilerStart and cudaProfilerStop, the
range ``ncu --profile-from-start off`` profiles. It prints nothing.
"""
from __future__ import annotations

import argparse

from . import shape as shapes
from .command import BACKENDS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashdecode.profile.target", description=__doc__)
    shapes.add_arguments(parser)
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--calls", type=int, default=2, help="profiled calls (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="calls before the profiled range (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        shape = shapes.from_args(args)
    except ValueError as error:
        parser.error(str(error))

    import torch

    import flashdecode

    inputs = shape.call(torch.device("cuda"))
    arguments = dict(inputs.kwargs(), backend=args.backend)
    for _ in range(args.warmup):
        flashdecode.flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **arguments)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.calls):
        flashdecode.flash_attn_with_kvcache(inputs.q, inputs.k_cache, inputs.v_cache, **arguments)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
