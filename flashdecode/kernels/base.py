"""The backend protocol, the arguments every launch takes, and the registry of backends.

A backend executes plans; it decides nothing. It answers the planner's capability questions
(which kernels it has, its default tile config for each, how many split programs one SM holds)
and says why it cannot take a call (``limitation``). ``select`` is the one rule that picks a
backend: the one named, or for ``"auto"`` the profile's ``Tuning.auto_order``.
"""
from __future__ import annotations

import abc
import dataclasses
import importlib

import torch

from .. import planner
from ..hardware import HardwareProfile
from ..problem import Problem


@dataclasses.dataclass
class LaunchArgs:
    """Everything a launch reads or writes, validated. Optional tensors are None when unused.

    q, out: (B, Sq, Hq, D); k_cache, v_cache: (B_cache, S, Hk, D) or pages (num_pages, page, Hk, D);
    k_new, v_new: (B, Sq_new, Hk, D); rotary_cos/sin: (S_ro, rotary_dim / 2); cache_seqlens,
    cache_batch_idx, cache_leftpad: int32 (B,); block_table: int32 (B, max_blocks); alibi_slopes:
    float32 (Hq,) or (B, Hq); k_descale, v_descale: float32 (B, Hk) (fp8 caches); lse: float32
    (B, Hq, Sq); part_o (W, Hk * Sq * G, D) and part_lse
    (W, Hk * Sq * G) float32, rows ``h * Sq * G + i * G + g``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    softmax_scale: float
    softcap: float = 0.0
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    rotary_cos: torch.Tensor | None = None
    rotary_sin: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    tickets: torch.Tensor | None = None  # int32 zeros, ``Plan.ticket_count`` of them (a merging split kernel)
    #: fp8 caches: float32 (B, Hk) views (``reference.descale_table``): cache values read as cache * descale
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # float32 (Hq,): each head's sink logit
    #: int32 (B + 1,): ragged queries; q, out (total_q, Hq, D), k_new, v_new (total_q, Hk, D), lse (Hq, total_q)
    cu_seqlens_q: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class FfiLaunch:
    """One launch as a TVM-FFI function call (TileLang's entry functions), for the compiled host path."""

    function: object  # a tvm_ffi.Function
    arguments: tuple  # tensors and scalars, in the function's order


#: Parameter kinds of a :class:`CudaLaunch`, as ``csrc/host_path.cpp`` numbers them.
POINTER, INT32, INT64, FLOAT32, INT8 = range(5)


@dataclasses.dataclass(frozen=True)
class CudaLaunch:
    """One launch as a CUDA function and its parameters (Triton's compiled kernels), for the
    compiled host path's ``cuLaunchKernel`` (``cuLaunchKernelEx`` where dependent)."""

    function: int  # CUfunction
    grid: tuple  # (x, y, z)
    block: int  # threads (x)
    shared: int  # dynamic shared memory, bytes
    arguments: tuple  # tensors (their data pointers), None (a null pointer), ints and floats
    kinds: tuple  # each argument's parameter kind: POINTER, INT32, INT64, FLOAT32 or INT8
    owner: object = None  # what keeps the function loaded (Triton's compiled kernel), held by the record
    dependent: bool = False  # a programmatic dependent launch (``cuLaunchKernelEx``; ``Plan.dependent_combine``)


#: KV tile sizes the shared-memory rule chooses from, largest first (16 is the smallest the matrix
#: units take).
BLOCK_N_CANDIDATES = (64, 32, 16)


def largest_block_n(headdim: int, element_bytes: int, profile: HardwareProfile, stages: int = 2,
                    programs: int = 2) -> int:
    """The largest KV tile whose ``stages`` pipelined K and V tiles let ``programs`` programs share a
    multiprocessor's shared memory (64 tokens at head dim 128, 32 at 256 on Hopper): TileLang's
    shared-memory rule (``docs/design.md``, "Measured choices"; its wide-head tile and Triton's
    ``triton_tiles`` are measured exceptions)."""
    budget = profile.shared_memory_per_multiprocessor // programs
    return next((block_n for block_n in BLOCK_N_CANDIDATES
                 if stages * 2 * block_n * headdim * element_bytes <= budget), BLOCK_N_CANDIDATES[-1])


class Backend(abc.ABC):
    """One implementation of the kernels. Instances live in the registry, one per process; each owns
    its compiled kernels (bounded caches keyed by tile config)."""

    name: str
    #: Whether its plans launch the plan's grid (``planner.GRID_YZ_LIMIT`` binds them); the reference has none.
    launches_grid: bool = True

    def unavailable(self) -> str | None:
        """Why this backend cannot run in this process at all (a missing package), or None."""
        return None

    @abc.abstractmethod
    def limitation(self, problem: Problem, device: torch.device) -> str | None:
        """What this call needs that the backend lacks, as "needs ..." text, or None if it can take it."""

    def problem_limitation(self, problem: Problem) -> str | None:
        """The part of ``limitation`` that the problem alone decides (on any device the backend
        runs on), for plans made without the device (``flashdecode profile``'s plan-only report)."""
        return None

    @abc.abstractmethod
    def kernels(self, problem: Problem) -> frozenset[str]:
        """The plan kernels (``planner.KERNELS``) the backend has for this problem."""

    @abc.abstractmethod
    def default_config(self, problem: Problem, profile: HardwareProfile, kernel: str):
        """The frozen tile config the backend runs ``kernel`` with for this problem."""

    @abc.abstractmethod
    def resident_programs(self, problem: Problem, config, profile: HardwareProfile) -> int:
        """Split programs of this config one multiprocessor holds at once."""

    def for_grid(self, config, problem: Problem, profile: HardwareProfile, kernel: str, programs: int, blocks: int):
        """``config`` for ``kernel``'s grid of at most ``programs`` working programs of at most
        ``blocks`` KV blocks each: what depends on the grid, such as the pipeline depth
        (``docs/design.md``, "The schedule"); the default keeps it."""
        return config

    def merges_in_split(self, problem: Problem) -> bool:
        """Whether the split kernel can merge a sequence's partials itself (``Plan.merge_in_split``)."""
        return False

    def launches_dependent_combine(self, problem: Problem) -> bool:
        """Whether the combine can be a programmatic dependent launch (``Plan.dependent_combine``)."""
        return False

    def block_ids_read_from(self, plan) -> int:
        """The kernels read a paged sequence's block ids from its first visible key rounded down to
        a multiple of this many keys (1: from that key's own page); the host check of the values
        reads the same entries (``validate.check_values``)."""
        return 1

    @abc.abstractmethod
    def launch(self, plan, problem: Problem, args: LaunchArgs) -> None:
        """Queue the plan's kernels on the current stream of q's device."""

    def host_launches(self, plan, problem: Problem, args: LaunchArgs) -> list | None:
        """The launches ``launch`` just made, as [:class:`FfiLaunch`] or [:class:`CudaLaunch`], which the
        compiled host path (``flashdecode.host_path``) replays for repeats of the call; None where
        they cannot be described so."""
        return None


#: Backend name -> "module:attribute" of a zero-argument factory, imported on first use (TileLang
#: and its compiler are optional).
REGISTRY = {
    "tilelang": "flashdecode.kernels.tilelang.backend:TileLangBackend",
    "triton": "flashdecode.kernels.triton.backend:TritonBackend",
    "reference": "flashdecode.kernels.reference:ReferenceBackend",
}
_instances: dict[str, Backend] = {}


class BackendError(ValueError):
    """A named backend cannot take the call (the message says which one can)."""


def get_backend(name: str) -> Backend:
    """The registry's backend of this name (created on first use)."""
    backend = _instances.get(name)
    if backend is None:
        if name not in REGISTRY:
            raise ValueError(f"backend must be one of {('auto', *REGISTRY)}, got {name!r}")
        module, attribute = REGISTRY[name].split(":")
        try:
            factory = getattr(importlib.import_module(module), attribute)
        except ImportError as error:
            factory = _unavailable_factory(name, error)
        backend = _instances.setdefault(name, factory())
    return backend


def _unavailable_factory(name: str, error: ImportError):
    reason = f"its module does not import ({error})"

    class Unavailable(Backend):
        def unavailable(self):
            return reason

        def limitation(self, problem, device):
            return reason

        def kernels(self, problem):
            return frozenset()

        def default_config(self, problem, profile, kernel):
            raise BackendError(f"backend {name!r} cannot run: {reason}")

        resident_programs = launch = default_config

    Unavailable.name = name
    return Unavailable


def why_not(name: str, problem: Problem, device: torch.device) -> str | None:
    """Why backend ``name`` cannot take this call on this device, or None."""
    backend = get_backend(name)
    return backend.unavailable() or backend.limitation(problem, device)


def select(requested: str, problem: Problem, device: torch.device, profile: HardwareProfile) -> Backend:
    """The backend that runs the call: the one named, else (``"auto"``) the first of the profile's
    ``auto_order`` whose rule admits the call and whose backend can take it; CPU tensors take the
    reference. Naming a backend that cannot take the call raises :class:`BackendError` naming one
    that can."""
    if requested != "auto":
        reason = why_not(requested, problem, device)
        if reason is not None:
            able = [name for name in REGISTRY if name != requested and why_not(name, problem, device) is None]
            hint = f"; backend {able[0]!r} can" if able else ""
            raise BackendError(f"backend {requested!r} cannot take this call: it needs {reason}{hint}")
        return get_backend(requested)
    if device.type != "cuda":
        return get_backend("reference")
    return get_backend(auto_choice(problem, profile, lambda name: why_not(name, problem, device) is None))


def auto_choice(problem: Problem, profile: HardwareProfile, can_take) -> str:
    """The name of the backend ``auto`` runs on a device of ``profile``: the first of its
    ``auto_order`` whose rule admits the call and for whose backend ``can_take(name)`` holds;
    "reference" when none."""
    plans: dict = {}  # backend name -> its plan for this call (None: it cannot take it), made once

    def plan_of(name):
        if name not in plans:
            plans[name] = planner.plan(problem, profile, get_backend(name)) if can_take(name) else None
        return plans[name]

    for rule in profile.tuning.auto_order:
        if (rule.admits(problem) and can_take(rule.backend)
                and not any(_splits(plan_of(name)) for name in rule.unsplit_by)
                and not any(_pipelines_deeper(name, plan_of(name), problem, profile)
                            for name in rule.not_pipelined_by)):
            return rule.backend
    return "reference"


def _splits(plan) -> bool:
    """Whether a backend's plan for the call splits it (False where the backend cannot take it: None)."""
    return plan is not None and plan.kernel == planner.SPLIT


def _pipelines_deeper(name: str, plan, problem: Problem, profile: HardwareProfile) -> bool:
    """Whether backend ``name``'s plan takes a deeper pipeline than its tile table (``Backend.for_grid``;
    False where it cannot take the call: None)."""
    return plan is not None and (plan.config.num_stages
                                 != get_backend(name).default_config(problem, profile, plan.kernel).num_stages)
