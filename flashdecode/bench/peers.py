"""Other decode-attention implementations the benchmark compares against, each used only if it imports.

Every peer is a ``setup(q, k_cache, v_cache, cache_seqlens)`` that does the one-time work (masks,
plans, compilation handles) outside the timed region and returns the call to time: a zero-argument
function giving ``out`` shaped like q, (batch, 1, nheads, headdim). Inputs are flashdecode's:
q (B, 1, Hq, D), k/v caches (B, S, Hk, D), int32 lengths.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from . import BenchError

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented workspace size


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str  # as given to --peers and shown in the output
    description: str
    cuda_only: bool
    probe: Callable[[], str]  # version string; raises (ImportError, ...) when the peer cannot run here
    setup: Callable


def _require_torch(major: int, minor: int, feature: str) -> str:
    if torch.torch_version.TorchVersion(torch.__version__) < (major, minor):
        raise ImportError(f"{feature} needs torch >= {major}.{minor}, this is {torch.__version__}")
    return f"torch {torch.__version__}"


def _probe_flash_attn() -> str:
    import flash_attn

    return f"flash_attn {flash_attn.__version__}"


def _setup_flash_attn(q, k_cache, v_cache, seqlens):
    from flash_attn import flash_attn_with_kvcache

    return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=0)


def _probe_flashinfer() -> str:
    import flashinfer

    return f"flashinfer {getattr(flashinfer, '__version__', 'unknown')}"


def _setup_flashinfer(q, k_cache, v_cache, seqlens):
    """One page per sequence (page size = seqlen_cache), so the cache is used as is, NHD layout."""
    import flashinfer

    batch, seqlen_cache, nheads_k, headdim = k_cache.shape
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    pages = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    plan = getattr(wrapper, "plan", None) or wrapper.begin_forward  # begin_forward: before 0.2
    plan(pages, pages[:-1], seqlens, q.shape[2], nheads_k, headdim, seqlen_cache,
         q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    run = getattr(wrapper, "run", None) or wrapper.forward
    q3 = q[:, 0]
    return lambda: run(q3, (k_cache, v_cache)).unsqueeze(1)


def _length_mask(seqlens, seqlen_cache):
    """(B, 1, 1, S) boolean: True where the token is within the sequence's length."""
    positions = torch.arange(seqlen_cache, device=seqlens.device)
    return (positions[None, :] < seqlens[:, None])[:, None, None, :]


def _setup_sdpa(q, k_cache, v_cache, seqlens):
    mask = _length_mask(seqlens, k_cache.shape[1])
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def _probe_flex() -> str:
    version = _require_torch(2, 5, "flex_attention with enable_gqa")
    import torch.nn.attention.flex_attention  # noqa: F401

    return version


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """torch.compile(flex_attention), one per process; every case is a new shape, so the
    recompile limit is raised for the 14 cases (and their fresh-input checks)."""
    from torch.nn.attention.flex_attention import flex_attention

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _setup_flex(q, k_cache, v_cache, seqlens):
    from torch.nn.attention.flex_attention import create_block_mask

    def within_length(b, h, q_idx, kv_idx):
        return kv_idx < seqlens[b]

    block_mask = create_block_mask(within_length, q.shape[0], None, 1, k_cache.shape[1], device=q.device)
    flex = _compiled_flex()
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return lambda: flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True).transpose(1, 2)


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer("fa2", "FlashAttention flash_attn_with_kvcache(num_splits=0)", True,
             _probe_flash_attn, _setup_flash_attn),
        Peer("flashinfer", "FlashInfer BatchDecodeWithPagedKVCacheWrapper, page = seqlen_cache", True,
             _probe_flashinfer, _setup_flashinfer),
        Peer("sdpa", "torch SDPA(enable_gqa=True) on the padded cache with a boolean length mask", False,
             lambda: _require_torch(2, 5, "SDPA with enable_gqa"), _setup_sdpa),
        Peer("flex", "torch.compile(flex_attention), enable_gqa=True, block mask of the lengths", True,
             _probe_flex, _setup_flex),
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
