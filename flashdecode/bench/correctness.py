"""The benchmark's correctness check: every row of out, and lse, against the float32 reference.

A row is one (sequence, query token, head) of out. Its tolerance follows FlashAttention's tests:
the candidate's largest error on the row may be at most ``OUT_ERROR_FACTOR`` times the largest
error of a same-dtype PyTorch run on that row (``reference_attention(compute_dtype=q.dtype)``:
scores, probabilities and values rounded as a bf16/fp16 implementation rounds them), plus a floor
of the dtype's epsilon times the row's largest reference value and ``OUT_ATOL`` (rows the
same-dtype run happens to get exact). Judging rows, not the whole tensor, is what catches one
wrong head in a large batch: a norm over the whole output dilutes it.

lse, where the system returns it, must be within ``LSE_ATOL`` of the reference's on every row:
our kernels compute scores in float32 from the inputs, so their lse differs from the float32
reference's by rounding alone (far below the same-dtype run's, whose scores are rounded to bf16),
while a softmax scale off by 1% moves a long row's lse by about 0.01.
"""
from __future__ import annotations

import dataclasses

import torch

from ..reference import reference_attention, relative_error

#: A row's error may be this many times the same-dtype run's (FlashAttention's tests use 2-3).
OUT_ERROR_FACTOR = 3.0
#: Absolute floor of every row's tolerance (as in FlashAttention's tests).
OUT_ATOL = 1e-5
#: Largest |lse - reference lse| on any row (natural log).
LSE_ATOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Expected:
    """What one call's output is judged against: the float32 reference and each row's tolerance."""

    out: torch.Tensor  # (B, Sq, H, D) in the inputs' dtype, computed in float32
    lse: torch.Tensor  # (B, H, Sq) float32
    row_tolerance: torch.Tensor  # (B, Sq, H) float32: the largest error each row of out may have


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One output judged: ``row_ratio`` is the worst row's error over its tolerance (above 1 fails;
    NaN anywhere gives inf), ``lse_error`` the worst |lse - reference| (None: no lse returned)."""

    rel_err: float  # ||out - ref|| / ||ref|| over the whole tensor: the table's summary figure
    row_ratio: float
    failed_rows: int
    lse_error: float | None

    @property
    def correct(self) -> bool:
        return self.row_ratio <= 1.0 and (self.lse_error is None or self.lse_error <= LSE_ATOL)


def _row_error(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Largest |out - reference| of each row (last dim), float32; NaN rows stay NaN."""
    return (out.float() - reference.float()).abs().amax(dim=-1)


def expected(call) -> Expected:
    """The reference of ``call`` (a ``cases.Call``) and its rows' tolerances from a same-dtype run.
    Both runs append the call's new tokens into its caches, as every system's call does."""
    out, lse = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs())
    same_dtype, _ = reference_attention(call.q, call.k_cache, call.v_cache, **call.kwargs(),
                                        compute_dtype=call.q.dtype)
    floor = torch.finfo(out.dtype).eps * out.float().abs().amax(dim=-1) + OUT_ATOL
    return Expected(out, lse, OUT_ERROR_FACTOR * _row_error(same_dtype, out) + floor)


def split_output(result) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of what a system's call returned: out alone, or (out, lse)."""
    if isinstance(result, tuple):
        return result[0], result[1]
    return result, None


def judge(result, reference: Expected) -> Verdict:
    """The verdict on one call's result (out, or (out, lse)) against ``reference``."""
    out, lse = split_output(result)
    if out.shape != reference.out.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(reference.out.shape)}")
    ratio = _row_error(out, reference.out) / reference.row_tolerance
    ratio = torch.nan_to_num(ratio, nan=float("inf"))
    lse_error = None
    if lse is not None:
        if lse.shape != reference.lse.shape:
            raise ValueError(f"lse shape {tuple(lse.shape)} differs from the reference's {tuple(reference.lse.shape)}")
        lse = lse.float()
        same_infinity = torch.isinf(reference.lse) & (lse == reference.lse)  # rows that see no key: -inf
        difference = torch.where(same_infinity, 0.0, (lse - reference.lse).abs())
        lse_error = float(torch.nan_to_num(difference, nan=float("inf")).max())
    return Verdict(relative_error(out, reference.out), float(ratio.max()), int((ratio > 1.0).sum()), lse_error)
