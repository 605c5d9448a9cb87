"""Other decode-attention implementations the benchmark compares against, each used only if it imports.

A peer's ``setup(calls)`` takes the ``cases.Call`` of every layer of one case and variant (same
lengths, own tensors), does the one-time work (masks, plans, page tables) outside the timed region
and returns one zero-argument function per call, giving ``out`` shaped like q (batch, seqlen_q,
nheads, headdim). ``limitation(call)`` says why the peer cannot take a call, or None:

- fa2: FlashAttention 2's flash_attn_with_kvcache, every variant whose pages are a multiple of 256
  tokens (its own rule). ``FLASHDECODE_FA2_PATH`` names a folder made by
  ``tools/build_fa2.py`` to import it from; else an installed flash_attn.
- flashinfer-tc / flashinfer-cc: FlashInfer's BatchDecodeWithPagedKVCacheWrapper with tensor cores
  on / off, plain (the contiguous cache viewed as pages of 16 tokens without a copy; a capacity off
  a multiple of 16 is padded up by a copy at setup, untimed) and paged (the call's page table); an
  fp8 cache (the ``fp8`` variant) planned with its kv dtype and run with one float k_scale/v_scale,
  FlashInfer's fp8 decode (the variant's descales are one value in every head).
- flashinfer-single: FlashInfer's single_decode_with_kv_cache (tensor cores), plain batch-1 cases.
- sdpa, flex: torch, plain only.

FlashAttention 2, flashinfer-single, sdpa and flex take no fp8 cache.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
from typing import Callable

import torch

from . import BenchError

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented workspace size
FLASHINFER_PAGE = 16  # the page FlashInfer views a contiguous cache in (h200-flashinfer.json)
FA2_PATH_VARIABLE = "FLASHDECODE_FA2_PATH"
#: The kernel head dims FlashAttention 2.8 dispatches a head dim to: the first at least as large
#: (HEADDIM_SWITCH in csrc/flash_attn/src/static_switch.h).
FA2_KERNEL_HEADDIMS = (32, 64, 96, 128, 192, 256)
FA2_PAGE_MULTIPLE = 256


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str  # as given to --peers and shown in the output
    description: str
    cuda_only: bool
    probe: Callable[[], str]  # version string; raises (ImportError, ...) when the peer cannot run here
    setup: Callable
    limitation: Callable  # call -> why the peer cannot take it, or None


def _require_torch(major: int, minor: int, feature: str) -> str:
    if torch.torch_version.TorchVersion(torch.__version__) < (major, minor):
        raise ImportError(f"{feature} needs torch >= {major}.{minor}, this is {torch.__version__}")
    return f"torch {torch.__version__}"


def _variant_parts(call) -> tuple[int, int, int]:
    """(page size or 0, seqlen_q, seqlen_new) of a call."""
    page = call.k_cache.shape[1] if call.block_table is not None else 0
    return page, call.q.shape[1], 0 if call.k is None else call.k.shape[1]


def _plain_only(call) -> str | None:
    if call.k_descale is not None:
        return "no fp8 caches"
    return None if _variant_parts(call) == (0, 1, 0) else "plain decode only (no pages, seqlen_q 1, no append)"


# --- FlashAttention 2 -------------------------------------------------------------------------

def _probe_fa2() -> str:
    folder = os.environ.get(FA2_PATH_VARIABLE)
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    import flash_attn

    version = f"flash_attn {flash_attn.__version__}"
    build = _fa2_build(folder)
    if build is not None:
        version += (f" (tools/build_fa2.py: {build['arch']}, head dims {build['headdims']}, "
                    f"without {', '.join(build['disabled']).lower()})")
    return version


@functools.lru_cache(maxsize=None)
def _fa2_build(folder: str | None) -> dict | None:
    """The BUILD.json of a ``tools/build_fa2.py`` build in ``folder``; None for any other
    install (every head dim's kernels)."""
    record = pathlib.Path(folder or "", "BUILD.json")
    return json.loads(record.read_text()) if folder and record.is_file() else None


def _fa2_limitation(call) -> str | None:
    if call.k_descale is not None:
        return "FlashAttention 2 has no fp8 caches"
    page = _variant_parts(call)[0]
    if page % FA2_PAGE_MULTIPLE:
        return f"FlashAttention 2 takes pages of a multiple of {FA2_PAGE_MULTIPLE} tokens, got {page}"
    headdim = call.q.shape[-1]
    kernel = next((d for d in FA2_KERNEL_HEADDIMS if d >= headdim), None)
    build = _fa2_build(os.environ.get(FA2_PATH_VARIABLE))
    if kernel is not None and build is not None and kernel not in build["headdims"]:
        return (f"this FlashAttention 2 build has kernels for head dims {list(build['headdims'])}; "
                f"head dim {headdim} takes {kernel}'s")
    return None


def _setup_fa2(calls):
    from flash_attn import flash_attn_with_kvcache

    return [functools.partial(flash_attn_with_kvcache, c.q, c.k_cache, c.v_cache, c.k, c.v,
                              cache_seqlens=c.cache_seqlens, block_table=c.block_table, causal=c.causal,
                              num_splits=0) for c in calls]


# --- FlashInfer -------------------------------------------------------------------------------

def _probe_flashinfer() -> str:
    import flashinfer

    return f"flashinfer {getattr(flashinfer, '__version__', 'unknown')}"


def _flashinfer_limitation(call) -> str | None:
    _, seqlen_q, seqlen_new = _variant_parts(call)
    if seqlen_q > 1 or seqlen_new:
        return "FlashInfer's decode wrapper: one query token over the cache as it is (no q4, no append)"
    if call.k_descale is not None and (call.k_descale.unique().numel() > 1 or call.v_descale.unique().numel() > 1):
        return "FlashInfer's decode takes one float k_scale and v_scale, the call has per-head descales"
    return None


def page_table(lengths: list[int], page_size: int, pages_of) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's (indptr, indices, last_page_len) of sequences of ``lengths`` tokens whose page j
    is ``pages_of(b)[j]``: ceil(L_b / page_size) pages each, the last holding the rest."""
    indptr, indices, last = [0], [], []
    for b, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"FlashInfer's page table needs every length >= 1, sequence {b} has {length}")
        count = -(-length // page_size)
        indices += pages_of(b)[:count]
        indptr.append(len(indices))
        last.append(length - (count - 1) * page_size)
    return indptr, indices, last


def _flashinfer_pages(call):
    """(k_pages, v_pages, page_size, pages_of): the call's pages, or its contiguous cache viewed as
    pages of FLASHINFER_PAGE tokens (padded to whole pages by a copy only where it is not)."""
    if call.block_table is not None:
        table = call.block_table.tolist()
        return call.k_cache, call.v_cache, call.k_cache.shape[1], lambda b: table[b]
    batch, capacity = call.k_cache.shape[:2]
    blocks = -(-capacity // FLASHINFER_PAGE)
    pad = (0, 0, 0, 0, 0, blocks * FLASHINFER_PAGE - capacity)
    k, v = (torch.nn.functional.pad(cache, pad) if pad[-1] else cache for cache in (call.k_cache, call.v_cache))
    shape = (batch * blocks, FLASHINFER_PAGE, *call.k_cache.shape[2:])
    return k.view(shape), v.view(shape), FLASHINFER_PAGE, lambda b: list(range(b * blocks, (b + 1) * blocks))


def _setup_flashinfer_batch(calls, tensor_cores: bool):
    """One wrapper planned once for all layers (they share lengths), as serving engines do; CUDA-graph
    mode with fixed index buffers, so the call can be captured."""
    import flashinfer

    first = calls[0]
    device = first.q.device
    pages = [_flashinfer_pages(call) for call in calls]
    indptr, indices, last = page_table(first.lengths, pages[0][2], pages[0][3])
    buffers = [torch.tensor(values, dtype=torch.int32, device=device) for values in (indptr, indices, last)]
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores, paged_kv_indptr_buffer=buffers[0],
        paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2])
    _, _, nheads, headdim = first.q.shape
    wrapper.plan(*buffers, nheads, first.k_cache.shape[2], headdim, pages[0][2], q_data_type=first.q.dtype,
                 kv_data_type=first.k_cache.dtype)

    def bind(call, k_pages, v_pages):
        q3 = call.q[:, 0]
        scales = {} if call.k_descale is None else {"k_scale": float(call.k_descale[0]),
                                                    "v_scale": float(call.v_descale[0])}
        return lambda: wrapper.run(q3, (k_pages, v_pages), **scales).unsqueeze(1)

    return [bind(call, k, v) for call, (k, v, _, _) in zip(calls, pages)]


def _single_limitation(call) -> str | None:
    if call.q.shape[0] != 1:
        return "single_decode_with_kv_cache takes batch 1 only"
    return _plain_only(call)


def _setup_flashinfer_single(calls):
    import flashinfer

    def bind(call):
        length = call.lengths[0]
        q, k, v = call.q[0, 0], call.k_cache[0, :length], call.v_cache[0, :length]
        return lambda: flashinfer.single_decode_with_kv_cache(q, k, v, "NHD", use_tensor_cores=True)[None, None]

    return [bind(call) for call in calls]


# --- torch ------------------------------------------------------------------------------------

def _length_mask(seqlens, seqlen_cache):
    """(B, 1, 1, S) boolean: True where the token is within the sequence's length."""
    positions = torch.arange(seqlen_cache, device=seqlens.device)
    return (positions[None, :] < seqlens[:, None])[:, None, None, :]


def _setup_sdpa(calls):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = _length_mask(calls[0].cache_seqlens, calls[0].k_cache.shape[1])

    def bind(call):
        qt, kt, vt = call.q.transpose(1, 2), call.k_cache.transpose(1, 2), call.v_cache.transpose(1, 2)
        return lambda: sdpa(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    return [bind(call) for call in calls]


def _probe_flex() -> str:
    version = _require_torch(2, 5, "flex_attention with enable_gqa")
    import torch.nn.attention.flex_attention  # noqa: F401

    return version


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """torch.compile(flex_attention), one per process; every case is a new shape, so the
    recompile limit is raised for the cases of both matrices (and their fresh-input checks)."""
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _setup_flex(calls):
    from torch.nn.attention.flex_attention import create_block_mask

    seqlens = calls[0].cache_seqlens

    def within_length(b, h, q_idx, kv_idx):
        return kv_idx < seqlens[b]

    first = calls[0]
    block_mask = create_block_mask(within_length, first.q.shape[0], None, 1, first.k_cache.shape[1],
                                   device=first.q.device)
    flex = _compiled_flex()

    def bind(call):
        qt, kt, vt = call.q.transpose(1, 2), call.k_cache.transpose(1, 2), call.v_cache.transpose(1, 2)
        return lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True).transpose(1, 2)

    return [bind(call) for call in calls]


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer("fa2", "FlashAttention flash_attn_with_kvcache(num_splits=0), the call's k/v, block_table, causal",
             True, _probe_fa2, _setup_fa2, _fa2_limitation),
        Peer("flashinfer-tc", f"FlashInfer BatchDecodeWithPagedKVCacheWrapper, tensor cores, NHD; plain: the cache "
                              f"viewed as pages of {FLASHINFER_PAGE}; plan() once per case, untimed", True,
             _probe_flashinfer, functools.partial(_setup_flashinfer_batch, tensor_cores=True), _flashinfer_limitation),
        Peer("flashinfer-cc", "the same wrapper with CUDA cores (use_tensor_cores=False)", True,
             _probe_flashinfer, functools.partial(_setup_flashinfer_batch, tensor_cores=False), _flashinfer_limitation),
        Peer("flashinfer-single", "FlashInfer single_decode_with_kv_cache(use_tensor_cores=True), batch 1", True,
             _probe_flashinfer, _setup_flashinfer_single, _single_limitation),
        Peer("sdpa", "torch SDPA(enable_gqa=True) on the padded cache with a boolean length mask", False,
             lambda: _require_torch(2, 5, "SDPA with enable_gqa"), _setup_sdpa, _plain_only),
        Peer("flex", "torch.compile(flex_attention), enable_gqa=True, block mask of the lengths", True,
             _probe_flex, _setup_flex, _plain_only),
    )
}


def select_peers(names: list[str] | None, cuda: bool) -> tuple[list[tuple[Peer, str]], list[str]]:
    """The peers to run, each with its version, and a note for every default peer left out.

    ``names`` None: every peer that imports and can run on this device. Named peers must all run,
    else :class:`BenchError`.
    """
    selected, skipped = [], []
    for name in names if names is not None else PEERS:
        peer = PEERS.get(name)
        if peer is None:
            raise BenchError(f"unknown peer {name!r}; known peers: {', '.join(PEERS)}")
        try:
            if peer.cuda_only and not cuda:
                raise ImportError("needs a CUDA device")
            selected.append((peer, peer.probe()))
        except Exception as error:  # noqa: BLE001 - a peer whose import breaks in any way cannot run
            if names is not None:
                raise BenchError(f"peer {name!r} cannot run here: {error}") from error
            skipped.append(f"{name}: {error}")
    return selected, skipped


def warm_up(name: str, headdim: int) -> None:
    """Call peer ``name`` once on a small bfloat16 CUDA case of head dim ``headdim``, so that its
    just-in-time modules (FlashInfer: 25-45 s each) are built before a benchmark, several in
    parallel processes (``tools/device.sh peers``)."""
    from .. import cases

    peer = PEERS[name]
    peer.probe()
    case = cases.Case(0, 1 if name == "flashinfer-single" else 2, 64, 8, 4, headdim)
    call = cases.make_call(case, cases.VARIANTS["plain"], "cuda")
    peer.setup([call])[0]()
    torch.cuda.synchronize()
