"""What a TileLang kernel is compiled for: its tile config (a frozen value the plan carries) and the
shape of the problem it is specialised on (:class:`KernelShape`).

Batch size, cache capacity, lengths, block ids, workspace rows, the number of programs, the softmax
scale, window sizes and the softcap value are runtime arguments, so new ones never recompile.
"""
import dataclasses

from ...problem import DTYPE_BYTES, DerivedSizes

#: Threads of the consumer warpgroup (the split kernel adds a 128-thread TMA producer warpgroup);
#: the short-cache kernel runs one such warpgroup.
CONSUMER_THREADS = 128
#: Sequences whose lengths a program reads at once when it locates its work: one parallel load per
#: SCAN_WIDTH sequences, into shared memory.
SCAN_WIDTH = 256


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """The combine kernel: ``step`` partials of a sequence are loaded at once, then merged."""

    step: int = 16


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """The split kernel (a TMA pipeline of ``num_stages`` K/V tiles of ``block_n`` tokens, a q tile
    of ``block_m`` rows) and the combine that follows it when sequences split.

    ``block_m`` 64 is one wgmma M tile; fewer rows run mma.sync. ``producer_registers``: what a
    thread of the producer warpgroup keeps after setmaxnreg (the consumer takes the rest); 0 keeps
    the even split."""

    block_n: int
    block_m: int = 64
    num_stages: int = 2
    producer_registers: int = 24
    combine: CombineConfig = CombineConfig()


@dataclasses.dataclass(frozen=True)
class ShortCacheConfig:
    """The short-cache kernel: one warpgroup, tiles of ``block_n`` tokens loaded directly, a q tile
    of ``block_m`` rows. ``one_tile``: the whole capacity fits one tile, so the kernel has no loop
    (it then reads one tile whatever the capacity: only for such caches)."""

    block_n: int
    block_m: int = 16
    one_tile: bool = False


@dataclasses.dataclass(frozen=True)
class KernelShape(DerivedSizes):
    """The part of a :class:`~flashdecode.problem.Problem` a kernel is compiled for: sizes that set
    its tiles, and the features that add code to it (each off gives the plain kernel)."""

    dtype: str
    headdim: int
    group: int
    nheads_k: int
    seqlen_q: int = 1
    page_size: int = 0  # 0: contiguous cache
    window_left: bool = False  # rows see keys from p_i - window_left on
    window_right: bool = False  # rows see keys up to p_i + window_right (causal: 0)
    softcap: bool = False
    append: bool = False  # new k/v tokens read from k/v and written into the cache
    sinks: bool = False  # a sink logit per query head in every row's softmax denominator
    cache_dtype: str | None = None  # an fp8 cache's dtype (None: q's), read as cache * descale
    heads_first: bool = False  # a contiguous cache stored (batch, nheads_k, capacity, headdim)
    leftpad: bool = False  # keys before cache_leftpad[b] are masked

    @classmethod
    def of(cls, problem) -> "KernelShape":
        return cls(problem.dtype, problem.headdim, problem.group, problem.nheads_k, problem.seqlen_q,
                   problem.page_size, problem.window_left >= 0, problem.window_right >= 0, problem.softcap,
                   problem.seqlen_new > 0, problem.sinks, problem.cache_dtype, problem.heads_first, problem.leftpad)

    @property
    def cache_element_bytes(self) -> int:
        """Bytes of one K or V element in the caches (1 for fp8, else ``element_bytes``)."""
        return self.element_bytes if self.cache_dtype is None else DTYPE_BYTES[self.cache_dtype]

    @property
    def plain(self) -> bool:
        """No feature: one query position, a contiguous (batch, capacity, nheads_k, headdim) cache of
        q's dtype, no appended tokens, windows, softcap, sinks or left pads."""
        return self == KernelShape(self.dtype, self.headdim, self.group, self.nheads_k)

    @property
    def windowed(self) -> bool:
        return self.window_left or self.window_right
