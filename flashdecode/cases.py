"""The 14-case benchmark matrix and its input generator, defined once for tests, bench and profile.

Every case: 32 query heads, head dim 128, bfloat16. ``../shared/anchors/h200-peers.json`` (copied
into ``flashdecode/data``) was measured on exactly these inputs.
"""
from __future__ import annotations

import dataclasses
import math

import torch

NHEADS = 32
HEADDIM = 128
DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    number: int
    batch: int
    seqlen_cache: int
    nheads_k: int
    group: int

    @property
    def nheads(self) -> int:
        return self.nheads_k * self.group

    def describe(self) -> str:
        return f"b{self.batch} s{self.seqlen_cache} hk{self.nheads_k} g{self.group}"


CASES: tuple[Case, ...] = tuple(
    Case(number, *shape)
    for number, shape in enumerate(
        [
            (1, 1, 4, 8), (4, 2, 8, 4), (16, 17, 4, 8), (64, 64, 8, 4), (16, 141, 4, 8),
            (16, 362, 8, 4), (64, 2048, 8, 4), (16, 4096, 4, 8), (32, 4096, 8, 4), (1, 8192, 4, 8),
            (16, 12251, 4, 8), (8, 32768, 8, 4), (1, 58966, 8, 4), (1, 61519, 4, 8),
        ],
        start=1,
    )
)
CASES_BY_NUMBER = {case.number: case for case in CASES}


def case_seqlens(batch: int, seqlen_cache: int) -> torch.Tensor:
    """The matrix's lengths: [seqlen_cache] for batch 1, else seeded randint with row 0 at full length."""
    if batch == 1:
        return torch.tensor([seqlen_cache], dtype=torch.int32)
    generator = torch.Generator("cpu").manual_seed(0)
    low = max(1, math.ceil(seqlen_cache / 4))
    lengths = torch.randint(low=low, high=seqlen_cache + 1, size=(batch,), generator=generator)
    lengths[0] = seqlen_cache
    return lengths.to(torch.int32)


def make_inputs(case: Case, device="cpu", dtype=DTYPE, headdim=HEADDIM, seed=1):
    """Fresh random q, k_cache, v_cache (randn, never zeros) and the case's cache_seqlens."""
    generator = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q = randn(case.batch, 1, case.nheads, headdim)
    k_cache = randn(case.batch, case.seqlen_cache, case.nheads_k, headdim)
    v_cache = randn(case.batch, case.seqlen_cache, case.nheads_k, headdim)
    seqlens = case_seqlens(case.batch, case.seqlen_cache).to(device)
    return q, k_cache, v_cache, seqlens


def bytes_read(case_or_lengths, nheads_k: int, nheads: int, headdim: int = HEADDIM, element_bytes: int = 2) -> int:
    """Bytes a decode call must move: K and V of the real tokens, plus q read and out written."""
    total_tokens = int(sum(case_or_lengths))
    batch = len(case_or_lengths)
    return (total_tokens * nheads_k * headdim * element_bytes * 2
            + 2 * batch * nheads * headdim * element_bytes)
