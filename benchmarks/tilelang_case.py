"""One matrix case on the GPU, set up for calling TileLang's split and combine kernels directly:
the inputs, the validated problem, the plan TileLang uses, and the
output and partial buffers (shared by hang_repro.py and producer_lag_check.py)."""
import dataclasses

import torch

from flashdecode import api, hardware
from flashdecode.cases import CASES_BY_NUMBER, make_inputs
from flashdecode.validate import validate


@dataclasses.dataclass
class SplitCall:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor
    problem: object
    profile: object
    plan: object
    out: torch.Tensor
    lse: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    scale: float

    def split_args(self):
        """The split kernel's arguments (decode.build_split_kernel's call order)."""
        return (self.q, self.k, self.v, self.seqlens, self.out, self.lse, self.part_o, self.part_lse,
                self.plan.programs_per_head, self.plan.forced_splits, self.plan.min_chunk, self.scale)

    def combine_args(self):
        """The combine kernel's arguments (decode.build_combine_kernel's call order)."""
        return (self.seqlens, self.part_o, self.part_lse, self.out, self.lse, self.problem.seqlen_cache,
                self.plan.programs_per_head, self.plan.forced_splits, self.plan.min_chunk)


def split_call(case_number: int) -> SplitCall:
    q, k, v, seqlens = make_inputs(CASES_BY_NUMBER[case_number], device="cuda")
    problem, _ = validate(q, k, v, seqlens, None, 0, "tilelang", None)
    profile = hardware.profile_for(q.device)
    plan = api.plan_for("tilelang", problem, profile)
    out, lse = torch.empty_like(q), torch.empty((problem.batch, problem.nheads), device="cuda")
    part_o, part_lse = api._partials(plan.programs_per_head, problem.nheads, problem.headdim, q.device)
    return SplitCall(q, k, v, seqlens, problem, profile, plan, out, lse, part_o, part_lse, problem.headdim ** -0.5)
