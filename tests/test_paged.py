"""Paged KV caches beyond FlashAttention's grid (which has pages of 256 only): pages of 1 to 256
tokens and of 768 (a multiple of 256 that is no power of two), shuffled block tables with spare pages no sequence owns, lengths 0, 1, capacity and one
random, with and without appended k/v. The public call against ``reference_attention`` on copies
of the same inputs: outputs, lse, and every page after the call (appends land in exactly the
right slots; no other page changes).

CPU tiers: "reference" and "triton" (its interpreter without CUDA), float16, small caches; pages of
16 in the fast tier, the other sizes ``slow``.
GPU tier (``gpu`` marker): "triton" and "tilelang", float16 and bfloat16; a backend that cannot
take a call (BackendError) is skipped with its message.
"""
import dataclasses
import math

import pytest
import torch

import flashdecode
from conftest import HAS_CUDA, slow_except
from flashdecode.kernels.base import BackendError
from flashdecode.reference import reference_attention, relative_error

DEVICE = "cuda" if HAS_CUDA else "cpu"
#: Powers of two, and a multiple of 256 that is not one (FlashAttention's page sizes are multiples of 256).
PAGE_SIZES = (1, 2, 16, 32, 64, 128, 256, 768)
BATCH, SPARE_PAGES = 4, 3


@dataclasses.dataclass(frozen=True)
class Variant:
    """The features a paged call uses besides its pages."""

    seqlen_q: int = 1
    seqlen_new: int = 0
    rotary: bool = False
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    num_splits: int = 0


VARIANTS = {
    "plain": Variant(num_splits=3),
    "append": Variant(seqlen_q=3, seqlen_new=3, rotary=True, causal=True),
    "extras": Variant(seqlen_q=2, window_size=(24, 0), softcap=30.0, alibi=True, num_splits=2),
    "serving": Variant(seqlen_q=2, seqlen_new=2, causal=True, softcap=30.0),  # all of it TileLang takes
}


@dataclasses.dataclass(frozen=True)
class Shape:
    nheads_k: int
    group: int
    headdim: int
    target_capacity: int  # tokens per sequence, rounded up to whole pages (at least two)


CPU_SHAPE = Shape(nheads_k=2, group=3, headdim=64, target_capacity=96)
GPU_SHAPE = Shape(nheads_k=4, group=8, headdim=128, target_capacity=3000)


def paged_call(page_size, variant: Variant, shape: Shape, dtype, seed):
    """Keyword arguments of one paged call with random inputs (never zeros)."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator, device=DEVICE, dtype=dtype)

    max_blocks = max(2, math.ceil(shape.target_capacity / page_size))
    capacity = max_blocks * page_size
    num_pages = BATCH * max_blocks + SPARE_PAGES
    nheads = shape.nheads_k * shape.group
    room = capacity - variant.seqlen_new
    random_length = int(torch.randint(2, room, (1,), generator=generator, device=DEVICE))
    lengths = torch.tensor([0, 1, room, random_length], dtype=torch.int32)
    order = torch.randperm(BATCH, generator=generator, device=DEVICE).cpu()
    pages = torch.randperm(num_pages, generator=generator, device=DEVICE)[:BATCH * max_blocks]
    call = dict(q=randn(BATCH, variant.seqlen_q, nheads, shape.headdim),
                k_cache=randn(num_pages, page_size, shape.nheads_k, shape.headdim),
                v_cache=randn(num_pages, page_size, shape.nheads_k, shape.headdim),
                cache_seqlens=lengths[order].to(DEVICE), block_table=pages.to(torch.int32).view(BATCH, max_blocks),
                causal=variant.causal, window_size=variant.window_size, softcap=variant.softcap)
    if variant.seqlen_new:
        call["k"] = randn(BATCH, variant.seqlen_new, shape.nheads_k, shape.headdim)
        call["v"] = randn(BATCH, variant.seqlen_new, shape.nheads_k, shape.headdim)
    if variant.rotary:
        angle = torch.rand(capacity, shape.headdim // 4, generator=generator, device=DEVICE) * 2 * math.pi
        call.update(rotary_cos=angle.cos().to(dtype), rotary_sin=angle.sin().to(dtype))
    if variant.alibi:
        call["alibi_slopes"] = torch.rand(nheads, generator=generator, device=DEVICE) * 0.3
    return call


def check_paged(backend, page_size, variant_name, shape, dtype, seed=0):
    variant = VARIANTS[variant_name]
    call = paged_call(page_size, variant, shape, dtype, seed)
    expected_call = dict(call, k_cache=call["k_cache"].clone(), v_cache=call["v_cache"].clone())
    expected_out, expected_lse = reference_attention(**expected_call)
    try:
        out, lse = flashdecode.flash_attn_with_kvcache(**call, num_splits=variant.num_splits,
                                                       return_softmax_lse=True, backend=backend)
    except BackendError as error:
        pytest.skip(f"{backend}: {error}")
    fp16 = dtype == torch.float16
    # Kernels round P to the input dtype before P @ V (relative L2 error ~1e-3 in float16, 8x in bfloat16)
    out_tolerance, cache_tolerance = (5e-3, 1e-3) if fp16 else (3e-2, 8e-3)
    assert out.shape == expected_out.shape and out.dtype == dtype and lse.shape == expected_lse.shape
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(expected_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows without keys differ from the reference's"
    assert (out.transpose(1, 2)[empty] == 0).all(), "rows without keys must be 0"
    for b in range(BATCH):
        if not empty[b].all():
            assert relative_error(out[b], expected_out[b]) < out_tolerance, f"sequence {b}"
    torch.testing.assert_close(lse[~empty], expected_lse[~empty], atol=2e-3, rtol=0)
    torch.testing.assert_close(call["k_cache"], expected_call["k_cache"], atol=cache_tolerance, rtol=cache_tolerance)
    assert torch.equal(call["v_cache"], expected_call["v_cache"]), "v pages after the call"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_size", slow_except(PAGE_SIZES, {16}))
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_paged_small(backend, page_size, variant):
    check_paged(backend, page_size, variant, CPU_SHAPE, torch.float16, seed=page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_paged_gpu(backend, page_size, variant, dtype):
    check_paged(backend, page_size, variant, GPU_SHAPE, dtype, seed=page_size)


#: Head dims whose tiles differ from head dim 128's: Triton's 128-token tiles at 64, 3 stages at 256,
#: TileLang's 16-row wide-head tile at 256 (gathered pages, appended tokens, windows and softcap in it).
GPU_WIDE_SHAPES = {"d64": Shape(nheads_k=4, group=8, headdim=64, target_capacity=3000),
                   "d256": Shape(nheads_k=2, group=8, headdim=256, target_capacity=3000)}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "serving"])
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("shape", GPU_WIDE_SHAPES)
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_paged_gpu_other_head_dims(backend, shape, page_size, variant):
    check_paged(backend, page_size, variant, GPU_WIDE_SHAPES[shape], torch.bfloat16, seed=page_size)


def test_block_tables_are_shuffled():
    """The inputs really are scattered: no sequence's pages are all consecutive ids."""
    for page_size in PAGE_SIZES:
        table = paged_call(page_size, VARIANTS["plain"], CPU_SHAPE, torch.float16, seed=page_size)["block_table"]
        steps = table[:, 1:] - table[:, :-1]
        assert (steps != 1).any(dim=1).all(), page_size

