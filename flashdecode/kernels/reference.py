"""The "reference" backend: ``reference_attention`` (PyTorch, float32) behind the Backend protocol.

It takes every call (CPU or CUDA tensors) and is the fallback of ``select`` on CPU. It runs no
kernel of its own, so the plan's kernel, config and grid change nothing; it answers the planner's
questions with one single-pass "program" per sequence.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import planner
from ..reference import reference_attention
from .base import Backend


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """The tile config the planner reads (``block_n``, ``block_m``); the reference ignores it."""

    block_n: int = 64
    block_m: int = 16


class ReferenceBackend(Backend):
    """Every feature of the surface, in PyTorch (``docs/design.md``, "Semantics")."""

    name = "reference"
    launches_grid = False

    def limitation(self, problem, device):
        return None

    def kernels(self, problem):
        return frozenset({planner.SINGLE_PASS})

    def default_config(self, problem, profile, kernel):
        return ReferenceConfig()

    def resident_programs(self, problem, config, profile):
        return 1

    def launch(self, plan, problem, args):
        """Appends k/v into the caches and writes ``args.out`` and ``args.lse`` (B, Hq, Sq; ragged:
        (Hq, total_q)) in place.
        Causal is ``problem.window_right == 0`` (validate folds it into the window). No autograd, as
        from a kernel: inputs that require grad (a model's sinks) leave no graph on the outputs, nor on
        the workspace's lse buffer that later calls write in place."""
        with torch.no_grad():
            out, lse = reference_attention(
                args.q, args.k_cache, args.v_cache, k=args.k_new, v=args.v_new,
                rotary_cos=args.rotary_cos, rotary_sin=args.rotary_sin, cache_seqlens=args.cache_seqlens,
                cache_batch_idx=args.cache_batch_idx, cache_leftpad=args.cache_leftpad,
                block_table=args.block_table, softmax_scale=args.softmax_scale,
                window_size=(problem.window_left, problem.window_right), softcap=args.softcap,
                rotary_interleaved=problem.rotary_interleaved, alibi_slopes=args.alibi_slopes,
                k_descale=args.k_descale, v_descale=args.v_descale, sinks=args.sinks,
                cu_seqlens_q=args.cu_seqlens_q)
            args.out.copy_(out)
            args.lse.copy_(lse)
