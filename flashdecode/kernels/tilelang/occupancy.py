"""Shared memory, registers and residency of the TileLang kernels.

Hardware facts (shared memory and registers per multiprocessor, the driver's shared-memory reserve
per program, the register limit per thread) come from the
:class:`~flashdecode.hardware.HardwareProfile`; the constants here are this backend's choices.
``shape`` arguments are a :class:`~flashdecode.problem.Problem` or a
:class:`~.config.KernelShape`: only their ``headdim``, ``element_bytes``, ``cache_element_bytes``
and ``paged`` are read.
"""
from .. import base
from .config import CONSUMER_THREADS, SCAN_WIDTH, ShortCacheConfig, SplitConfig

#: Most programs of one kernel ptxas is asked to fit on one multiprocessor (``__launch_bounds__``).
MAX_RESIDENT_PROGRAMS = 4
#: The shared-memory rule for ``block_n``: this many pipelined K/V stages of this many programs fit
#: one multiprocessor.
RULE_STAGES, RULE_PROGRAMS = 2, 2
#: Most registers a consumer thread of the split kernel asks setmaxnreg for.
CONSUMER_REGISTER_CAP = 240
#: setmaxnreg counts registers in multiples of this.
REGISTER_GRANULE = 8


def largest_block_n(shape, profile) -> int:
    """``kernels.base.largest_block_n`` for RULE_PROGRAMS programs of RULE_STAGES stages of q's dtype
    (an fp8 cache's tiles take as much: half-size stages and one converted pair, ``split_shared_bytes``)."""
    return base.largest_block_n(shape.headdim, shape.element_bytes, profile, RULE_STAGES, RULE_PROGRAMS)


def split_shared_bytes(shape, config: SplitConfig, profile) -> int:
    """Shared memory of one split program: the q tile, the pipelined K/V stages (the last, partial
    tile reuses them), with an fp8 cache the K/V tiles converted to q's dtype, P for q tiles under
    64 rows, the lengths being scanned, and the driver's reserve."""
    rows, block_n, size = config.block_m, config.block_n, shape.element_bytes
    q_tile = rows * shape.headdim * size
    stages = config.num_stages * 2 * block_n * shape.headdim * shape.cache_element_bytes
    converted = 2 * block_n * shape.headdim * size if shape.cache_element_bytes != size else 0
    probabilities = rows * block_n * size if rows < 64 else 0
    return q_tile + stages + converted + probabilities + SCAN_WIDTH * 4 + profile.driver_reserved_shared_per_program


def short_cache_shared_bytes(shape, config: ShortCacheConfig, profile) -> int:
    """Shared memory of one short-cache program: q, K and V tiles (of q's dtype: an fp8 cache is
    converted as it is loaded), P for q tiles under 64 rows, the block ids being checked (paged
    caches)."""
    rows, block_n, size = config.block_m, config.block_n, shape.element_bytes
    probabilities = rows * block_n * size if rows < 64 else 0
    block_ids = SCAN_WIDTH * 4 if shape.paged else 0
    return ((rows + 2 * block_n) * shape.headdim * size + probabilities + block_ids
            + profile.driver_reserved_shared_per_program)


def consumer_registers(headdim: int, block_n: int, rows: int) -> int:
    """Registers a consumer thread needs: the output's rows * D / threads values, scores and
    probabilities 1.5 * rows * block_n / threads, and ~16 for addressing."""
    return (rows * headdim + 3 * rows * block_n // 2) // CONSUMER_THREADS + 16


def programs_that_fit(registers: int, threads: int, shared_bytes: int, profile) -> int:
    """Programs of ``threads`` threads needing ``registers`` each and ``shared_bytes`` that fit on one
    multiprocessor at once, between 1 and MAX_RESIDENT_PROGRAMS."""
    by_registers = max((n for n in range(1, MAX_RESIDENT_PROGRAMS + 1)
                        if registers <= min(profile.max_registers_per_thread,
                                            profile.registers_per_multiprocessor // (n * threads))), default=1)
    return max(1, min(by_registers, profile.shared_memory_per_multiprocessor // shared_bytes))


def resident_programs(shape, config, profile) -> int:
    """Programs of ``config``'s kernel one multiprocessor holds at once. A split program also
    launches the 128-thread producer warpgroup, which gets the consumer's register count at launch
    (ptxas holds all of the kernel's code to that count, setmaxnreg or not)."""
    registers = consumer_registers(shape.headdim, config.block_n, config.block_m)
    if isinstance(config, SplitConfig):
        return programs_that_fit(registers, 2 * CONSUMER_THREADS, split_shared_bytes(shape, config, profile),
                                 profile)
    if isinstance(config, ShortCacheConfig):
        return programs_that_fit(registers, CONSUMER_THREADS, short_cache_shared_bytes(shape, config, profile),
                                 profile)
    raise TypeError(f"config must be a SplitConfig or ShortCacheConfig, got {config!r}")


def register_split(config: SplitConfig, resident: int, profile) -> tuple[int, int] | None:
    """(producer, consumer) registers a thread of the split kernel's two warpgroups keeps after
    setmaxnreg, or None for the even split (``producer_registers`` 0): the producer keeps
    ``producer_registers`` and the consumer takes what it gives up within the program's launch
    share, at most CONSUMER_REGISTER_CAP."""
    producer = config.producer_registers
    if not producer:
        return None
    most = profile.max_registers_per_thread // REGISTER_GRANULE * REGISTER_GRANULE
    share = profile.registers_per_multiprocessor // (resident * 2 * CONSUMER_THREADS)
    launch = min(most, share // REGISTER_GRANULE * REGISTER_GRANULE)
    return producer, min(CONSUMER_REGISTER_CAP, 2 * launch - producer)
