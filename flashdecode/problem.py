"""What one call computes, as a small frozen value: shapes, dtype and the features it uses.

A :class:`Problem` is built once per distinct call metadata by ``validate`` and is the key of every
cache downstream (plans, compiled kernels). It holds only what changes the schedule or the compiled
kernel; runtime values (lengths, block ids, positions, the softmax scale, the softcap value) travel
with the tensors (:class:`LaunchArgs`), so new lengths or new block tables never recompile.

Coordinates (``docs/design.md``, "Semantics"): sequence b has ``L_b = cache_seqlens[b] + seqlen_new``
keys at absolute positions ``[0, L_b)``; keys before ``cache_leftpad[b]`` are masked; query row i
sits at absolute position ``L_b - seqlen_q + i`` (causal alignment bottom-right, as FlashAttention).
With ragged queries (``cu_seqlens_q``) sequence b has its own ``q_b = cu_seqlens_q[b + 1] -
cu_seqlens_q[b]`` rows (at most ``seqlen_q``, the call's ``max_seqlen_q``) and appends ``q_b`` tokens;
``q_b`` replaces ``seqlen_q`` and ``seqlen_new`` in these formulas.
"""
from __future__ import annotations

import dataclasses

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
#: fp8 cache dtypes (q stays float16/bfloat16): each dequantised in registers (``Problem.cache_dtype``).
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")

#: ``Problem.alibi`` values: no ALiBi, one slope per query head, one per (sequence, query head).
ALIBI_NONE, ALIBI_PER_HEAD, ALIBI_PER_SEQUENCE = 0, 1, 2


class DerivedSizes:
    """What a :class:`Problem` and a compiled kernel's shape (TileLang's ``KernelShape``) derive
    alike from their ``dtype``, ``seqlen_q``, ``group`` and ``page_size``."""

    @property
    def q_rows(self) -> int:
        """Query rows one KV head serves: row r = i * group + g, query position i of head h * group + g
        (``docs/design.md``, "GQA packing")."""
        return self.seqlen_q * self.group

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def paged(self) -> bool:
        return self.page_size > 0


@dataclasses.dataclass(frozen=True)
class Problem(DerivedSizes):
    """The shape and the features of one call, as validated from its tensors."""

    batch: int
    seqlen_cache: int  # keys one sequence can hold: the cache's length, or max_blocks * page_size when paged
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str  # "float16" | "bfloat16"
    seqlen_q: int = 1
    page_size: int = 0  # 0: contiguous cache (batch_cache, seqlen_cache, Hk, D); else pages of this many tokens
    seqlen_new: int = 0  # tokens of k/v appended to the cache in this call (0: none)
    rotary_dim: int = 0  # 0: no rotary embedding
    rotary_interleaved: bool = False  # only meaningful with rotary_dim > 0
    window_left: int = -1  # keys a row sees before its own position; -1: unbounded
    window_right: int = -1  # keys after it; -1: unbounded; causal is window_right == 0
    softcap: bool = False
    alibi: int = ALIBI_NONE
    leftpad: bool = False  # cache_leftpad given
    batch_idx: bool = False  # cache_batch_idx given
    #: q, caches, new k/v, block_table and out contiguous (sizes of 1 taking any stride) and 16-byte
    #: aligned, the caches possibly heads-first (and, without cache_batch_idx or block_table, a cache
    #: of exactly batch rows)
    dense: bool = True
    offsets_32: bool = False  # every K/V element lies within 2**31 - 1 elements of its cache's start (offsets_fit_32)
    #: None: the caches hold q's dtype; else one of FP8_DTYPES, dequantised as cache * k_descale/v_descale
    cache_dtype: str | None = None
    sinks: bool = False  # per-head sink logits join every row's softmax denominator
    #: q packed (total_q, nheads, headdim) by cu_seqlens_q: seqlen_q is max_seqlen_q, each sequence's
    #: rows (and, appending, its new tokens: seqlen_new is then max_seqlen_q too) are read on the device
    ragged: bool = False
    #: contiguous caches stored (batch, nheads_k, seqlen_cache, headdim), seen (batch, seqlen_cache,
    #: nheads_k, headdim) through a transpose, as transformers keeps them (``is_heads_first``)
    heads_first: bool = False

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def windowed(self) -> bool:
        """Causal or a sliding window: rows see keys up to a limit relative to their own position.
        (``validate`` folds causal into ``window_right = 0`` and drops windows that cannot bind.)"""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def causal(self) -> bool:
        return self.window_left < 0 and self.window_right == 0

    @property
    def cache_element_bytes(self) -> int:
        """Bytes of one K or V element in the caches (1 for fp8, else ``element_bytes``)."""
        return self.element_bytes if self.cache_dtype is None else DTYPE_BYTES[self.cache_dtype]

    def key_span(self) -> int:
        """Most keys one sequence's rows can see together: the capacity, or fewer under a left window."""
        if self.window_left < 0:
            return self.seqlen_cache
        return min(self.seqlen_cache, self.seqlen_q + self.window_left)

    def cache_bytes(self) -> int:
        """Bytes of K and V a call could read: the whole capacity of every sequence."""
        return 2 * self.batch * self.seqlen_cache * self.nheads_k * self.headdim * self.cache_element_bytes

    def features(self) -> tuple[str, ...]:
        """The names of the features beyond plain decode this call uses (for capability checks)."""
        names = []
        if self.seqlen_q > 1:
            names.append("seqlen_q>1")
        for name, used in (("paged", self.paged), ("append", self.seqlen_new > 0), ("rotary", self.rotary_dim > 0),
                           ("causal", self.causal), ("window", self.windowed and not self.causal),
                           ("softcap", self.softcap), ("alibi", self.alibi != ALIBI_NONE),
                           ("leftpad", self.leftpad), ("batch_idx", self.batch_idx),
                           ("fp8", self.cache_dtype is not None), ("sinks", self.sinks), ("ragged", self.ragged),
                           ("heads_first", self.heads_first)):
            if used:
                names.append(name)
        return tuple(names)


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a size-0 dimension counts as 1)."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def is_contiguous(shape, strides) -> bool:
    """Whether ``strides`` lay a tensor of ``shape`` out contiguously, a dimension of size 1 taking any
    stride (as ``torch.Tensor.is_contiguous`` and TileLang's argument checks have it)."""
    return all(size == 1 or stride == expected
               for size, stride, expected in zip(shape, strides, contiguous_strides(shape)))


def is_heads_first(shape, strides) -> bool:
    """Whether a (batch, seqlen, nheads, headdim) tensor of ``strides`` is a contiguous (batch, nheads,
    seqlen, headdim) one seen through ``transpose(1, 2)`` (sizes of 1 taking any stride)."""
    order = (0, 2, 1, 3)
    return is_contiguous([shape[axis] for axis in order], [strides[axis] for axis in order])


def offsets_fit_32(shape, strides=None) -> bool:
    """Whether every element of a tensor of ``shape`` (and ``strides``; contiguous when None) lies
    within 2**31 - 1 elements of its start: the kernels may then address it in 32 bits."""
    if strides is None:
        strides = contiguous_strides(shape)
    return sum((size - 1) * abs(stride) for size, stride in zip(shape, strides) if size > 0) < 2 ** 31
