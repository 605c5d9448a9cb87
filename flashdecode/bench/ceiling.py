"""The in-run bandwidth ceiling: how fast this device streams a large buffer from memory.

A Triton kernel reads the buffer once with wide contiguous loads and writes one float per program;
it is timed with the same :class:`~flashdecode.bench.timing.Timer` (cold L2) as the decode calls,
so each result's fraction of the ceiling compares like with like. Without CUDA, ``torch.sum`` over a
CPU buffer stands in (Triton's interpreter measures the interpreter, not memory).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .results import Ceiling
from .timing import Timer

READ_BLOCK = 2048  # elements per load step: 16 bf16 (32 bytes) per thread with 4 warps
READ_TILES = 16  # load steps per program: 64 KiB read per program
CUDA_BUFFER_BYTES = 2 * 1024 ** 3
CPU_BUFFER_BYTES = 256 * 1024 ** 2


@triton.jit
def _stream_read_kernel(src, partial_sums, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """Program p sums elements [p * BLOCK * TILES, (p + 1) * BLOCK * TILES) of ``src``."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * TILES)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for tile in tl.static_range(TILES):  # unrolled: all loads of a program in flight at once
        acc += tl.load(src + start + tile * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(partial_sums + tl.program_id(0), tl.sum(acc, axis=0))


def stream_read(src: torch.Tensor, partial_sums: torch.Tensor) -> torch.Tensor:
    """Read all of ``src`` (1-D, a multiple of READ_BLOCK * READ_TILES elements); one sum per program."""
    programs = src.numel() // (READ_BLOCK * READ_TILES)
    if programs * READ_BLOCK * READ_TILES != src.numel() or partial_sums.numel() != programs:
        raise ValueError(f"src must hold a multiple of {READ_BLOCK * READ_TILES} elements, "
                         "partial_sums one float per program")
    _stream_read_kernel[(programs,)](src, partial_sums, BLOCK=READ_BLOCK, TILES=READ_TILES, num_warps=4)
    return partial_sums


def measure_ceiling(timer: Timer) -> Ceiling:
    """Time a streaming read with ``timer``: the Triton kernel over 2 GiB of bf16 on CUDA, else
    ``torch.sum`` over 256 MiB of float32."""
    if timer.cuda:
        src = torch.ones(CUDA_BUFFER_BYTES // 2, dtype=torch.bfloat16, device=timer.device)
        partial_sums = torch.empty(src.numel() // (READ_BLOCK * READ_TILES), dtype=torch.float32,
                                   device=timer.device)
        timing = timer.time(lambda: stream_read(src, partial_sums))
        what = f"Triton streaming read of {CUDA_BUFFER_BYTES / 1024 ** 3:.0f} GiB bfloat16"
    else:
        src = torch.ones(CPU_BUFFER_BYTES // 4, dtype=torch.float32)
        timing = timer.time(src.sum)
        what = f"torch.sum over {CPU_BUFFER_BYTES / 1024 ** 2:.0f} MiB float32 on the CPU"
    return Ceiling(what, src.numel() * src.element_size(), timing.median_us,
                   src.numel() * src.element_size() / timing.median_us / 1e3)
