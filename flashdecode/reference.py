"""PyTorch reference for decode attention: the oracle of every test and the CPU fallback.

float32 accumulation, masked softmax, one sequence at a time so only its real tokens are touched
(no padded-cache blow-up on long contexts). Rows of length 0 give output 0 and LSE -inf.
"""
from __future__ import annotations

import math

import torch


def reference_decode(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """Returns (out, lse): out (batch, 1, nheads, headdim) in q's dtype, lse (batch, nheads, 1) fp32.

    ``cache_seqlens`` is an int32 tensor (batch,) on any device; it is read on the host.
    """
    batch, _, nheads, headdim = q.shape
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    out = torch.zeros(batch, nheads, headdim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, nheads), float("-inf"), dtype=torch.float32, device=q.device)
    for b, length in enumerate(cache_seqlens.tolist()):
        if length == 0:
            continue
        qb = q[b, 0].float().view(nheads_k, group, headdim)
        kb = k_cache[b, :length].float()  # (length, nheads_k, headdim)
        vb = v_cache[b, :length].float()
        scores = torch.einsum("hgd,shd->hgs", qb, kb) * scale
        row_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.exp(scores - row_lse)
        out[b] = torch.einsum("hgs,shd->hgd", probs, vb).reshape(nheads, headdim)
        lse[b] = row_lse.reshape(nheads)
    return out.to(q.dtype).unsqueeze(1), lse.unsqueeze(-1)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference|| in float32 (NaN anywhere gives NaN, which fails)."""
    if out.shape != reference.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(reference.shape)}")
    reference = reference.float()
    return float(torch.linalg.vector_norm(out.float() - reference) / torch.linalg.vector_norm(reference))
