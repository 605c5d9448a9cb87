"""The public calls: FlashAttention 2's ``flash_attn_with_kvcache``, its project name, and the route
a call would take. Each is validate -> select -> plan -> launch through a DecodeContext."""
from __future__ import annotations

import dataclasses

import torch

from . import compat
from .context import DecodeContext, default_context
from .planner import Plan
from .problem import Problem
from .validate import tensor_scalars, value_checks_enabled


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend="auto", out=None, sinks=None, cu_seqlens_q=None, max_seqlen_q=None,
                            context=None):
    """Attention of a few new query tokens per sequence over a KV cache: FlashAttention 2's call,
    with its arguments, positional order, defaults and return shapes (``docs/design.md``,
    "Semantics"; the README documents every argument).

    q (batch, seqlen_q, nheads, headdim); k_cache, v_cache (batch_cache, seqlen_cache, nheads_k,
    headdim), or pages (num_pages, page_size, nheads_k, headdim) with ``block_table`` (batch,
    max_blocks) int32; k, v (batch, seqlen_new, nheads_k, headdim) appended to the cache in place at
    ``cache_seqlens`` (int32 (batch,), an int, or None for full caches). Returns out (batch,
    seqlen_q, nheads, headdim) in q's dtype, and with ``return_softmax_lse`` the natural-log lse
    (batch, nheads, seqlen_q) float32.

    Beyond FlashAttention: ``backend`` ("auto", "tilelang", "triton", "reference"), ``out`` (a
    preallocated output) and ``context`` (a :class:`DecodeContext` owning the workspace; default: one
    per host thread and stream); ``sinks`` (float32 (nheads,): a logit per head in every row's
    softmax denominator and lse) and ragged queries, FlashAttention 3's ``cu_seqlens_q`` (int32
    (batch + 1,)) with ``max_seqlen_q``: q (total_q, nheads, headdim), k, v (total_q, nheads_k,
    headdim), out packed like q, lse (nheads, total_q). Calls with these take the Python path.
    """
    extras = dict(sinks=sinks, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
    if compat.is_compiling():
        from . import ops

        return ops.traced_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                               rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, backend, out)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if context is not None:
        run = context.run
    else:
        context = default_context(q)  # bound to q's device and the current stream
        host = context._host  # its compiled host path, once a call made it (None where off)
        if host is not None and not value_checks_enabled() and sinks is cu_seqlens_q is max_seqlen_q is None:
            # a repeat call: straight to the extension (no frame of the context's in between)
            found = host.run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, backend, out,
                             context._stream)
            if found is not None:
                return found
        run = context._run  # the first call of a metadata, a capture, scalars of other types: the Python path
    return run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
               return_softmax_lse, backend, out, **extras)


def flash_decode_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, *, k=None, v=None, rotary_cos=None,
                              rotary_sin=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                              backend="auto", out=None, sinks=None, cu_seqlens_q=None, max_seqlen_q=None,
                              context=None):
    """The same call as :func:`flash_attn_with_kvcache`, with ``cache_seqlens`` as the fourth
    positional argument and every other argument keyword-only (flashdecode's own name)."""
    return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                   rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse,
                                   backend=backend, out=out, sinks=sinks, cu_seqlens_q=cu_seqlens_q,
                                   max_seqlen_q=max_seqlen_q, context=context)


@dataclasses.dataclass(frozen=True)
class Route:
    """What a call would run: the backend's name, the call's Problem and the Plan."""

    backend: str
    problem: Problem
    plan: Plan


def plan_for(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
             cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
             *, backend="auto", out=None, sinks=None, cu_seqlens_q=None, max_seqlen_q=None,
             context=None) -> Route:
    """The Route the same call to :func:`flash_attn_with_kvcache` takes (validated; nothing runs)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    ctx = context if context is not None else DecodeContext(q.device)
    softmax_scale, causal, softcap, rotary_interleaved, num_splits = tensor_scalars(
        softmax_scale, causal, softcap, rotary_interleaved, num_splits)
    problem, chosen, plan, _, _ = ctx.resolve(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                              cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                              window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                              backend, out, sinks, cu_seqlens_q, max_seqlen_q)
    return Route(chosen.name, problem, plan)
