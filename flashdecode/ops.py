"""The call as torch.library custom ops with fake implementations, so that it traces under
``torch.compile(fullgraph=True)``: ``api.flash_attn_with_kvcache`` routes here while torch.compile
traces, and eager calls skip the dispatcher (its cost would double the host time of a small call).

Two ops, so that a call that appends nothing does not declare the caches mutated (a mutated graph
input makes the compiler copy it, the whole cache): ``flashdecode::attend`` reads the caches,
``flashdecode::attend_append`` also writes k/v into them. Their schema is made from the declared
arguments (``call.ARGUMENTS``, each in its ``traced_as`` type; those without one are left out:
``out`` is filled by a copy, and the ops always return the lse).
"""
from __future__ import annotations

import numbers

import torch

from .call import ARGUMENTS, Call
from .context import default_context
from .validate import check_out, descale_number, tensor_meta

#: The ops' arguments, in ARGUMENTS order.
TRACED = tuple(argument for argument in ARGUMENTS if argument.traced_as is not None)
#: The arguments that may be a number (checked) as well as a float32 tensor: traced as a 0-d tensor.
DESCALES = ("k_descale", "v_descale")
#: The arguments ``attend_append`` writes the appended k and v into.
APPENDED_INTO = ("k_cache", "v_cache")
#: An argument's value in the ops' types, by its ``traced_as`` (a tensor or None as it is).
_AS_TRACED = {"float": float, "bool": bool, "int": int, "str": str,
              "float?": lambda value: None if value is None else float(value),
              "int?": lambda value: None if value is None else int(value),
              "int[]": lambda value: [int(item) for item in value]}


def _schema(mutated: tuple[str, ...]) -> str:
    """The ops' schema, with the ``mutated`` tensors marked as written."""
    marks = iter("abcdefghijklmnopqrstuvwxyz")
    return "(" + ", ".join(f"{argument.traced_as}({next(marks)}!) {argument.name}" if argument.name in mutated
                           else f"{argument.traced_as} {argument.name}" for argument in TRACED) + ") -> (Tensor, Tensor)"


def _run(*values):
    """An op's implementation: the call on the default context of its stream; (out, lse)."""
    call = Call(**{argument.name: tuple(value) if argument.traced_as == "int[]" else value
                   for argument, value in zip(TRACED, values)}, return_softmax_lse=True)
    return default_context(call.q).run_call(call)


def _fake(q, *values):
    if q.dim() == 3:  # ragged queries (cu_seqlens_q): lse (nheads, total_q)
        return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


attend = torch.library.custom_op("flashdecode::attend", _run, mutates_args=(), schema=_schema(()))
attend.__doc__ = "flash_attn_with_kvcache without appended tokens; returns (out, lse)."
attend_append = torch.library.custom_op("flashdecode::attend_append", _run, mutates_args=APPENDED_INTO,
                                        schema=_schema(APPENDED_INTO))
attend_append.__doc__ = "flash_attn_with_kvcache appending k/v into the caches; returns (out, lse)."
attend.register_fake(_fake)
attend_append.register_fake(_fake)


def traced_call(call: Call, context=None):
    """The public call while torch.compile traces: the arguments in the ops' types (an int length
    and a descale number become tensors, the window a list of ints), one of the two ops, and ``out``
    (checked here: the ops never see it) filled by a copy. The ops run on the default context of
    their stream, so a ``context`` is refused rather than left unused."""
    q = call.q
    if context is not None:
        raise ValueError("context: under torch.compile the call runs on the default context of q's device and "
                         "stream; call without context= there (its tuning and config apply to eager calls)")
    if call.out is not None and isinstance(q, torch.Tensor):
        check_out(tensor_meta("out", call.out, traced=True), tensor_meta("q", q, traced=True))
    values = []
    for argument in TRACED:
        value = getattr(call, argument.name)
        if argument.name == "cache_seqlens" and value is not None and not isinstance(value, torch.Tensor):
            batch = q.shape[0] if call.cu_seqlens_q is None else call.cu_seqlens_q.shape[0] - 1
            value = torch.full((batch,), int(value), dtype=torch.int32, device=q.device)
        elif argument.name in DESCALES and isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = torch.tensor(descale_number(argument.name, value, traced=True), dtype=torch.float32,
                                 device=q.device)
        elif argument.traced_as in _AS_TRACED:
            value = _AS_TRACED[argument.traced_as](value)
        values.append(value)
    op = attend if call.k is None and call.v is None else attend_append
    result, lse = op(*values)
    if call.out is not None:
        call.out.copy_(result)
        result = call.out
    return (result, lse) if call.return_softmax_lse else result
