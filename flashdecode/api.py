"""The public calls: FlashAttention 2's ``flash_attn_with_kvcache``, its project name, and the route
a call would take. Each is validate -> select -> plan -> launch through a DecodeContext.

Their signatures come from the declared argument list (``call.ARGUMENTS``), generated with
``call.define``: the plain call is one Python frame in front of the compiled host path's
``HostPath.run`` (the extension's own function) on a repeat call.
"""
from __future__ import annotations

import dataclasses

from torch import Tensor

from .call import DECODE_POSITIONAL, Call, define, parameters
# (F401: names only the generated functions below use, as their globals)
from .compat import is_compiling  # noqa: F401
from .context import DecodeContext, checked_call, default_context, new_call, read_scalars  # noqa: F401
from .ops import traced_call  # noqa: F401
from .planner import Plan
from .problem import Problem
from .validate import value_checks_enabled  # noqa: F401

_CALL = """
def {name}({parameters}, context=None):
    if is_compiling():
        return traced_call(Call({arguments}), context)  # (a plain namedtuple for torch.compile to trace)
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {{type(q).__name__}}")
    if context is not None:
        return context.run({arguments})
    context = default_context(q)  # bound to q's device and the current stream
    host = context.host_path  # its compiled host path, once a call made it (None where off)
    if host is not None and not value_checks_enabled():
        # a repeat call: straight to the extension (no frame of the context's in between)
        found = host.run({arguments}, context.stream)
        if found is not None:
            return found
    # the first call of a metadata, a capture, scalars of other types: the Python path
    return context.run_call(new_call(({arguments},)))
"""

flash_attn_with_kvcache = define(_CALL, globals(), "flash_attn_with_kvcache", doc="""\
    Attention of a few new query tokens per sequence over a KV cache: FlashAttention 2's call,
    with its arguments, positional order, defaults and return shapes (``docs/design.md``,
    "Semantics"; docs/api.md documents every argument).

    q (batch, seqlen_q, nheads, headdim); k_cache, v_cache (batch_cache, seqlen_cache, nheads_k,
    headdim), or pages (num_pages, page_size, nheads_k, headdim) with ``block_table`` (batch,
    max_blocks) int32; k, v (batch, seqlen_new, nheads_k, headdim) appended to the cache in place at
    ``cache_seqlens`` (int32 (batch,), an int, or None for full caches). Returns out (batch,
    seqlen_q, nheads, headdim) in q's dtype, and with ``return_softmax_lse`` the natural-log lse
    (batch, nheads, seqlen_q) float32.

    Beyond FlashAttention: ``backend`` ("auto", "tilelang", "triton", "reference"), ``out`` (a
    preallocated output) and ``context`` (a :class:`DecodeContext` owning the workspace; default: one
    per host thread and stream). fp8 caches (float8_e4m3fn, float8_e5m2, q float16/bfloat16), as
    FlashAttention 3: ``k_descale``, ``v_descale`` (float32 (batch, nheads_k), (nheads_k,) or (), or a
    number; None: 1) read the caches as ``cache * descale``; appended k/v (q's dtype) are stored as
    ``x / descale`` saturated to the fp8 range, rounded to nearest even.
    """)

flash_decode_with_kvcache = define(_CALL, globals(), "flash_decode_with_kvcache",
                                   parameters=parameters(positional=DECODE_POSITIONAL), doc="""\
    The same call as :func:`flash_attn_with_kvcache`, with ``cache_seqlens`` as the fourth
    positional argument and every other argument keyword-only (flashdecode's own name).""")


@dataclasses.dataclass(frozen=True)
class Route:
    """What a call would run: the backend's name, the call's Problem and the Plan."""

    backend: str
    problem: Problem
    plan: Plan


def _route(call: Call, context: DecodeContext | None) -> Route:
    """``plan_for`` of a Call."""
    if not isinstance(call.q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(call.q).__name__}")
    context = context if context is not None else DecodeContext(call.q.device)
    call = read_scalars(call)
    problem, chosen, plan, host_checks, copies = context.resolve(call)
    checked_call(call, problem, chosen, plan, host_checks, copies)  # the index values, checked as the call checks them
    return Route(chosen.name, problem, plan)


plan_for = define("""
def {name}({parameters}, context=None) -> Route:
    return _route(new_call(({arguments},)), context)
""", globals(), "plan_for", doc="""\
    The Route the same call to :func:`flash_attn_with_kvcache` takes (validated; nothing runs).""")
