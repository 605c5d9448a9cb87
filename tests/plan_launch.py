"""Inputs and a plan-level launch of the Triton backend for the sinks and ragged-query tests.

``make_inputs`` draws one small call (padded or ragged, with or without sinks); ``through_plan``
runs it on a plan of a small tile config, with a split plan's partials merged by the split kernel
or by the combine kernel as asked (what the public call's tuning would choose, forced both ways),
and may swap index tensors after validation (values the public call rejects).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from conftest import HAS_CUDA
from flashdecode import plan_for
from flashdecode.hardware import PROFILES
from flashdecode.kernels.base import LaunchArgs
from flashdecode.kernels.triton.backend import TritonBackend, TritonConfig
from flashdecode.planner import SPLIT, plan
from flashdecode.reference import reference_attention, relative_error

DEVICE = "cuda" if HAS_CUDA else "cpu"
#: Short caches span many blocks and splits: 16-key blocks, 16-row tiles, 2 partials per combine step.
SMALL = TritonConfig(block_n=16, block_m=16, num_warps=4, num_stages=2, combine_step=2)
BACKEND = TritonBackend()


def make_inputs(batch=3, capacity=80, nheads_k=2, group=2, headdim=32, seqlen_q=1, rows=None, append=False,
                lengths=None, page_size=0, causal=False, window=(-1, -1), softcap=0.0, sinks=False, seed=0,
                dtype=torch.float16) -> tuple:
    """(q, k_cache, v_cache, keyword arguments) of one call. ``rows``: a ragged call's query rows per
    sequence (q, k, v packed by ``cu_seqlens_q``, ``max_seqlen_q`` = seqlen_q); ``append``: each
    sequence appends as many tokens as it has query rows; ``lengths``: cache_seqlens (default: the
    capacity less the appended tokens, less 7 more per sequence); ``sinks``: one logit per head."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    nheads = nheads_k * group
    counts = [seqlen_q] * batch if rows is None else list(rows)
    if page_size:
        blocks = -(-capacity // page_size)
        k_cache, v_cache = randn(batch * blocks + 2, page_size, nheads_k, headdim), \
            randn(batch * blocks + 2, page_size, nheads_k, headdim)
        order = torch.randperm(batch * blocks + 2, generator=generator)[:batch * blocks]
        table = order.view(batch, blocks).to(torch.int32).to(DEVICE)
        capacity = blocks * page_size
    else:
        k_cache, v_cache, table = randn(batch, capacity, nheads_k, headdim), randn(batch, capacity, nheads_k, headdim), None
    if lengths is None:
        lengths = [max(0, capacity - (count if append else 0) - 7 * b) for b, count in enumerate(counts)]
    kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), block_table=table,
                  causal=causal, window_size=window, softcap=softcap)
    if rows is None:
        q = randn(batch, seqlen_q, nheads, headdim)
        if append:
            kwargs.update(k=randn(batch, seqlen_q, nheads_k, headdim), v=randn(batch, seqlen_q, nheads_k, headdim))
    else:
        total = sum(counts)
        q = randn(total, nheads, headdim)
        kwargs.update(cu_seqlens_q=torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=DEVICE),
                      max_seqlen_q=seqlen_q)
        if append:
            kwargs.update(k=randn(total, nheads_k, headdim), v=randn(total, nheads_k, headdim))
    if sinks:
        kwargs["sinks"] = (torch.randn(nheads, generator=generator) * 2).to(DEVICE)
    return q, k_cache, v_cache, kwargs


def through_plan(q, k_cache, v_cache, kwargs, num_splits=0, merge=False, config=SMALL, **replaced):
    """(out, lse, k_cache, v_cache) of ``TritonBackend.launch`` on copies of the caches, with the
    plan of ``num_splits`` and ``config``; a split plan merges in the split kernel when ``merge``
    (twice, on the same counters, which must be back at zero), else in the combine kernel.
    ``replaced``: index tensors swapped in after the call was validated."""
    problem = plan_for(q, k_cache, v_cache, **kwargs, num_splits=num_splits, backend="triton").problem
    chosen = plan(problem, PROFILES["h200"], BACKEND, num_splits, config=config)
    if chosen.kernel == SPLIT:
        chosen = dataclasses.replace(chosen, merge_in_split=merge)
    tickets = torch.zeros(max(1, chosen.ticket_count(problem)), dtype=torch.int32, device=DEVICE)
    kwargs = dict(kwargs, **replaced)
    out = torch.full_like(q, 7.0)
    lse_shape = (problem.nheads, q.shape[0]) if problem.ragged else (problem.batch, problem.nheads, problem.seqlen_q)
    lse = torch.empty(lse_shape, device=DEVICE)
    rows = problem.nheads_k * problem.q_rows
    part_o = torch.empty(chosen.workspace_rows, rows, problem.headdim, device=DEVICE)
    part_lse = torch.empty(chosen.workspace_rows, rows, device=DEVICE)
    for _ in range(2 if chosen.merge_in_split else 1):
        k_copy, v_copy = k_cache.clone(), v_cache.clone()
        BACKEND.launch(chosen, problem, LaunchArgs(
            q, k_copy, v_copy, kwargs["cache_seqlens"], out, lse, part_o, part_lse, problem.headdim ** -0.5,
            kwargs["softcap"], kwargs.get("k"), kwargs.get("v"), block_table=kwargs.get("block_table"),
            tickets=tickets, sinks=kwargs.get("sinks"), cu_seqlens_q=kwargs.get("cu_seqlens_q")))
        assert not tickets.any(), "the merging kernel left its counters non-zero"
    return out, lse, k_copy, v_copy


def reference(q, k_cache, v_cache, kwargs):
    """(out, lse, k_cache, v_cache) of ``reference_attention`` on copies of the caches."""
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    arguments = {name: value for name, value in kwargs.items() if name != "max_seqlen_q"}  # read from cu_seqlens_q
    out, lse = reference_attention(q, k_copy, v_copy, **arguments)
    return out, lse, k_copy, v_copy


def check_plan_against_reference(inputs, num_splits, merge, out_tolerance, lse_tolerance):
    """``through_plan`` of ``inputs`` (make_inputs' tuple) against ``reference``: out within
    ``out_tolerance`` (relative L2), lse within ``lse_tolerance``, the caches' appended rows equal."""
    out, lse, k_cache, v_cache = through_plan(*inputs, num_splits=num_splits, merge=merge)
    ref_out, ref_lse, ref_k, ref_v = reference(*inputs)
    assert relative_error(out, ref_out) < out_tolerance
    assert torch.allclose(lse, ref_lse, atol=lse_tolerance)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
