"""The call as torch.library custom ops with fake implementations, so that it traces under
``torch.compile(fullgraph=True)``: ``api.flash_attn_with_kvcache`` routes here while torch.compile
traces, and eager calls skip the dispatcher (its cost would double the host time of a small call).

Two ops, so that a call that appends nothing does not declare the caches mutated (a mutated graph
input makes the compiler copy it, the whole cache): ``flashdecode::attend`` reads the caches,
``flashdecode::attend_append`` also writes k/v into them.
"""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
         block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
         num_splits, backend):
    from .api import flash_attn_with_kvcache

    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                       cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                       (window_left, window_right), softcap, rotary_interleaved, alibi_slopes,
                                       num_splits, True, backend=backend)
    return out, lse


@torch.library.custom_op("flashdecode::attend", mutates_args=())
def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
           cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
           softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
           alibi_slopes: Optional[Tensor], num_splits: int, backend: str) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache without appended tokens; returns (out, lse)."""
    return _run(q, k_cache, v_cache, None, None, None, None, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, causal, window_left, window_right, softcap, True, alibi_slopes,
                num_splits, backend)


@torch.library.custom_op("flashdecode::attend_append", mutates_args=("k_cache", "v_cache"))
def attend_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, rotary_cos: Optional[Tensor],
                  rotary_sin: Optional[Tensor], cache_seqlens: Tensor, cache_batch_idx: Optional[Tensor],
                  cache_leftpad: Optional[Tensor], block_table: Optional[Tensor], softmax_scale: Optional[float],
                  causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                  alibi_slopes: Optional[Tensor], num_splits: int, backend: str) -> tuple[Tensor, Tensor]:
    """flash_attn_with_kvcache appending k/v into the caches; returns (out, lse)."""
    return _run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                alibi_slopes, num_splits, backend)


def _fake(q, *args, **kwargs):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


attend.register_fake(_fake)
attend_append.register_fake(_fake)


def traced_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                return_softmax_lse, backend, out):
    """The public call while torch.compile traces: the arguments in the ops' types (an int length
    becomes a tensor, the window a pair of ints), one of the two ops, and ``out`` filled by a copy."""
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    window_left, window_right = (int(side) for side in window_size)
    scale = None if softmax_scale is None else float(softmax_scale)
    if k is None and v is None:
        result, lse = attend(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, scale,
                             bool(causal), window_left, window_right, float(softcap), alibi_slopes, int(num_splits),
                             backend)
    else:
        result, lse = attend_append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, block_table, scale, bool(causal), window_left,
                                    window_right, float(softcap), bool(rotary_interleaved), alibi_slopes,
                                    int(num_splits), backend)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_softmax_lse else result
