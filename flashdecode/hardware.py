"""Hardware profiles: the only place in flashdecode where hardware numbers live.

The planner sizes its grid and tiles from a :class:`HardwareProfile` and takes its thresholds from
the profile's :class:`Tuning`; the benchmark sizes its L2 flush from it. ``current()`` reads the
CUDA device in use; ``PROFILES`` holds named profiles so plans can be computed and tested on a
machine without that device.

Sources of the named numbers (see docs/hardware/):
- H100 SXM and H200: NVIDIA datasheets (SMs, shared memory, bandwidth); L2 as PyTorch reports it
  on the H200 this project measures on (60 MiB), 50 MiB for the H100.
- MetaX C500: the vendor's figures as given in this project's brief (104 compute units, wave64,
  64 KiB shared memory per unit, 8 MiB L2, about 1.8 TB/s). Its register file size is not in
  that brief: 64 Ki registers per unit is an assumption (the NVIDIA figure), to be checked.
- Registers: 64 Ki 32-bit registers per SM on Hopper (CUDA programming guide).
- Tuning: measured on the H200; docs/tuning.md cites the measurement behind each value.
"""
from __future__ import annotations

import dataclasses
import functools

KIB = 1024
MIB = 1024 * KIB


@dataclasses.dataclass(frozen=True)
class AutoRule:
    """One entry of ``auto``'s order: a backend and the calls it is chosen for (None: no limit)."""

    backend: str
    max_cache_bytes: int | None = None  # K and V bytes at capacity, below this
    max_headdim: int | None = None  # at most this
    plain_cache_only: bool = False  # only calls that read a contiguous cache and append nothing
    #: only calls that none of these backends' plans split (``kernels.base.select`` asks the planner)
    unsplit_by: tuple[str, ...] = ()
    #: only calls that none of these backends' plans pipeline deeper than their tile table
    #: (``Backend.for_grid``; ``kernels.base.select`` asks the planner)
    not_pipelined_by: tuple[str, ...] = ()
    #: only calls whose features (``Problem.features``) are all among these; None: any feature
    features: tuple[str, ...] | None = None

    def admits(self, problem) -> bool:
        """Whether this rule's limits hold for ``problem`` (a :class:`~flashdecode.problem.Problem`)."""
        return ((self.max_cache_bytes is None or problem.cache_bytes() < self.max_cache_bytes)
                and (self.max_headdim is None or problem.headdim <= self.max_headdim)
                and not (self.plain_cache_only and (problem.paged or problem.seqlen_new > 0))
                and (self.features is None or set(problem.features()) <= set(self.features)))


#: The features of the calls ``auto`` may give TileLang: those its kernels were measured with on the
#: H200 (docs/design.md, "Who runs what"). Calls with sinks, fp8 caches, left pads or heads-first
#: caches, which its kernels also take, stay on Triton under ``auto`` (the measurements: docs/design.md).
TILELANG_AUTO_FEATURES = ("seqlen_q>1", "paged", "append", "causal", "window", "softcap")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The schedule's thresholds, the tile tables and the ``auto`` rule of one device: values, never
    reassigned (a sweep passes another Tuning). The defaults hold on every device; the fields whose
    default is off (empty, 0, None, False) turn a rule on where it was measured (``HOPPER_TUNING``).
    docs/tuning.md gives the measurement behind every value."""

    #: Programs aimed for per multiprocessor when a batch splits.
    programs_per_multiprocessor: int = 3
    #: Fewest KV blocks a split carries (unless its sequence is shorter) where the split kernel merges
    #: the splits.
    min_blocks_per_split: int = 4
    #: The same where the combine merges them, and for underfilled batches (``underfilled_merge_caps``),
    #: by backend name (others: ``min_blocks_per_split``).
    min_blocks_per_combined_split: tuple[tuple[str, int], ...] = ()
    #: The same for a batch of one sequence, by backend name (others: the rules above), however its
    #: splits are merged.
    min_blocks_per_one_sequence_split: tuple[tuple[str, int], ...] = ()
    #: Caches of at most this many KV blocks are not split (but see the next field).
    split_above_blocks: int = 8
    #: By backend name: caches of more than this many blocks (and at most ``split_above_blocks``)
    #: split into 1-block programs where unsplit they would launch fewer programs (batch * KV heads *
    #: row tiles) than the device has multiprocessors.
    underfilled_split_above_blocks: tuple[tuple[str, int], ...] = ()
    #: Unsplit caches of at most this many tiles take a backend's short-cache kernel.
    short_cache_max_blocks: int = 4
    #: Split plans whose sequences get at most this many splits merge them in the split kernel
    #: (``Plan.merge_in_split``: one launch) where the backend can; 0: never (its ordering of partials
    #: through a GPU-scope atomic is checked on NVIDIA's devices only).
    max_splits_merged_in_split: int = 0
    #: Split plans merge in the split kernel only where the most splits a sequence can get times the
    #: row tile (the partial rows a merging program reads) is at most this too; None: no such limit.
    max_rows_merged_in_split: int | None = None
    #: (most splits, most partial rows) merged in the split kernel where a batch's grid is underfilled
    #: (``Plan.min_chunk_binds``): such plans take the combine's minimum
    #: (``min_blocks_per_combined_split``) and merge only within these caps (and the caps above);
    #: None: the caps above, at ``min_blocks_per_split``.
    underfilled_merge_caps: tuple[int, int] | None = None
    #: Ragged calls whose whole K/V cache (``Problem.cache_bytes``) is at most this many bytes take
    #: Triton tiles of one query's rows (a sequence's further row tiles read its keys again, cheap
    #: only on small caches; docs/tuning.md); 0: tiles of all ``max_seqlen_q`` rows.
    ragged_query_tiles_max_cache_bytes: int = 0
    #: Split plans that keep a combine launch it as a programmatic dependent launch
    #: (``Plan.dependent_combine``) where the backend and the device can.
    dependent_combine: bool = False
    #: ``auto``'s order (:class:`AutoRule`): the first rule whose limits hold and whose backend can
    #: take the call runs it.
    auto_order: tuple = (AutoRule("tilelang", max_cache_bytes=32 * MIB, plain_cache_only=True,
                                  unsplit_by=("tilelang", "triton"), not_pipelined_by=("triton",),
                                  features=TILELANG_AUTO_FEATURES),
                         AutoRule("triton", max_headdim=128), AutoRule("tilelang", features=TILELANG_AUTO_FEATURES),
                         AutoRule("triton"))
    #: Triton's split-kernel tile by padded head dim (at most): (head dim, block_n, num_warps,
    #: num_stages).
    triton_tiles: tuple = ((32, 64, 4, 2), (64, 128, 4, 2), (128, 64, 4, 2), (256, 64, 4, 3))
    #: Pipeline stages of Triton's kernels where the grid leaves shared memory over
    #: (``triton.backend.pipelined``); 0: the tile table's always.
    triton_pipelined_stages: int = 0
    #: Pipeline stages of Triton's kernels over contiguous fp8 caches, in place of the tile table's
    #: and ``triton_pipelined_stages`` (0: as 16-bit caches).
    triton_fp8_stages: int = 0
    #: Triton's kernels read an fp8 cache's V tile as 16-bit words (``TritonConfig.fp8_v_words``;
    #: its conversion needs sm_89 or later).
    triton_fp8_v_words: bool = False
    #: Split programs of Triton's kernel one multiprocessor holds, by padded head dim (at most).
    triton_resident_programs: tuple = ((64, 4), (128, 4), (256, 1))
    #: The same table for paged caches (empty: ``triton_resident_programs``); the register cap aims at it.
    triton_paged_resident_programs: tuple = ()
    #: The register cap's programs an SM for the split kernel's 32-row tiles over several query tokens
    #: a sequence, contiguous 16-bit caches only, by padded head dim, where lower than the tables'
    #: (empty: the tables above): under the tables' cap they spill; the grids it pays for are
    #: ``triton.backend.split_32_row_resident``'s.
    triton_split_32_row_resident_programs: tuple = ()

    def __post_init__(self):
        """Every field as ``_FIELD_CHECKS`` says (TypeError/ValueError naming it): a plan divides by
        some counts, sizes its grid or pipeline with others, and indexes the tables by row."""
        for field in dataclasses.fields(self):
            _FIELD_CHECKS[field.name](f"tuning.{field.name}", getattr(self, field.name))


#: Most programs an SM a tuning may aim for or count on: twice Hopper's resident blocks (32).
MAX_PROGRAMS_PER_MULTIPROCESSOR = 64
#: Most pipeline stages a tuning may ask for: far past any measured (2-4); the planner drops
#: stages one at a time until a tile fits shared memory.
MAX_STAGES = 16


def check_int(name: str, value, least: int = 0, most: int | None = None, power_of_two: bool = False) -> None:
    """``value`` an int (not a bool) in [least, most] (None: no upper bound), a power of two where
    asked; TypeError/ValueError naming ``name`` (Tuning's fields, ``validate.check_tile_config``'s)."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < least or most is not None and value > most or power_of_two and value & (value - 1):
        rule = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{name} must be {'a power of two ' if power_of_two else ''}{rule}, got {value!r}")


def _count(least: int = 0, most: int | None = None, optional: bool = False):
    """A check of an int field in [least, most] (None: no upper bound; ``optional``: None allowed)."""
    def check(name: str, value) -> None:
        if not (optional and value is None):
            check_int(name, value, least, most)
    return check


def _flag(name: str, value) -> None:
    """A check of a bool field."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _rows(lead: type | None, *columns: tuple, not_empty: bool = False, optional: bool = False):
    """A check of a table: a tuple of rows, each a ``lead`` (a backend name: str; a head dim: int;
    None: a single row of numbers, the field itself) then one number per column, a column being
    (least, most, power of two)."""
    ints = f"{len(columns)} int{'s' if len(columns) > 1 else ''}"
    shape = f"({'backend name' if lead is str else 'head dim'}, {ints}) rows" if lead else ints

    def check(name: str, value) -> None:
        if optional and value is None:
            return
        rows = (value,) if lead is None else value
        if not isinstance(value, tuple) or not_empty and not value or not all(
                isinstance(row, tuple) and len(row) == len(columns) + (lead is not None) for row in rows):
            raise TypeError(f"{name} must be a {'non-empty ' if not_empty else ''}tuple of {shape}, got {value!r}")
        for row in rows:
            if lead is str and not isinstance(row[0], str):
                raise TypeError(f"{name} must lead each row with a backend name, got {value!r}")
            numbers = row if lead is None else row[1:]
            if lead is int:
                check_int(name, row[0], 1)
            for number, (least, most, power_of_two) in zip(numbers, columns):
                check_int(name, number, least, most, power_of_two)
    return check


_PROGRAMS = (1, MAX_PROGRAMS_PER_MULTIPROCESSOR, False)
#: How each Tuning field is checked (``Tuning.__post_init__``); a new field needs its entry here.
_FIELD_CHECKS = {
    "programs_per_multiprocessor": _count(1, MAX_PROGRAMS_PER_MULTIPROCESSOR),
    "min_blocks_per_split": _count(1),
    "min_blocks_per_combined_split": _rows(str, (1, None, False)),
    "min_blocks_per_one_sequence_split": _rows(str, (1, None, False)),
    "split_above_blocks": _count(),
    "underfilled_split_above_blocks": _rows(str, (0, None, False)),
    "short_cache_max_blocks": _count(),
    "max_splits_merged_in_split": _count(),
    "max_rows_merged_in_split": _count(optional=True),
    "underfilled_merge_caps": _rows(None, (0, None, False), (0, None, False), optional=True),
    "ragged_query_tiles_max_cache_bytes": _count(),
    "dependent_combine": _flag,
    "auto_order": lambda name, value: None,  # AutoRule values, read by kernels.base.select
    "triton_tiles": _rows(int, (16, None, True), (1, 32, True), (1, MAX_STAGES, False), not_empty=True),
    "triton_pipelined_stages": _count(0, MAX_STAGES),
    "triton_fp8_stages": _count(0, MAX_STAGES),
    "triton_fp8_v_words": _flag,
    "triton_resident_programs": _rows(int, _PROGRAMS, not_empty=True),
    "triton_paged_resident_programs": _rows(int, _PROGRAMS),
    "triton_split_32_row_resident_programs": _rows(int, _PROGRAMS),
}


#: Hopper's tuning (H100, H200), measured on the H200 (docs/tuning.md): the merge in the split kernel,
#: a dependent combine, shorter splits for Triton's combined, one-sequence and underfilled plans,
#: deeper pipelines where the grid leaves shared memory over, 3 stages over contiguous fp8 caches, fp8
#: V tiles read as 16-bit words (measured on an H100), the paged kernel's register cap, and the
#: split kernel's for 32-row tiles over several query tokens (measured on an H100).
HOPPER_TUNING = Tuning(max_splits_merged_in_split=16, max_rows_merged_in_split=512, dependent_combine=True,
                       underfilled_merge_caps=(8, 256),
                       min_blocks_per_combined_split=(("triton", 2),),
                       min_blocks_per_one_sequence_split=(("triton", 1),),
                       underfilled_split_above_blocks=(("triton", 4),), triton_pipelined_stages=4,
                       triton_fp8_stages=3, triton_fp8_v_words=True, ragged_query_tiles_max_cache_bytes=MIB,
                       triton_paged_resident_programs=((64, 4), (128, 5), (256, 1)),
                       triton_split_32_row_resident_programs=((64, 4), (128, 3), (256, 1)))


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What a schedule needs to know about a device."""

    name: str
    multiprocessors: int  # SMs (NVIDIA) / compute units (MetaX)
    shared_memory_per_multiprocessor: int  # bytes
    l2_bytes: int
    wave_width: int  # threads per warp / wavefront
    registers_per_multiprocessor: int  # 32-bit registers
    hbm_bandwidth: float  # bytes per second, vendor figure (the benchmark measures its own ceiling)
    tuning: Tuning = Tuning()  # measured on the H200 except where a profile names its own
    #: Bytes of shared memory the driver reserves per program (CUDA programming guide, sm_90).
    driver_reserved_shared_per_program: int = 1 * KIB
    max_registers_per_thread: int = 255
    #: Programmatic dependent launch (griddepcontrol, compute capability 9.0 and later): what
    #: ``Tuning.dependent_combine`` needs of the device, whatever tuning a context passes.
    dependent_launch: bool = False


PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", 132, 228 * KIB, 50 * MIB, 32, 64 * KIB, 3.35e12, HOPPER_TUNING,
                            dependent_launch=True),
    "h200": HardwareProfile("h200", 132, 228 * KIB, 60 * MIB, 32, 64 * KIB, 4.8e12, HOPPER_TUNING,
                            dependent_launch=True),
    # Triton's resident programs computed from its split program's shared memory (35-41 KB at head
    # dims 64-256) against 64 KiB per AP, not measured (docs/hardware/c500.md).
    "c500": HardwareProfile("c500", 104, 64 * KIB, 8 * MIB, 64, 64 * KIB, 1.8e12,
                            Tuning(triton_resident_programs=((64, 1), (128, 1), (256, 1)))),
}


def _named_profile_for(device_name: str) -> HardwareProfile | None:
    lowered = device_name.lower()
    for key, profile in PROFILES.items():
        if key in lowered:
            return profile
    return None


@functools.lru_cache(maxsize=None)
def current(device_index: int | None = None) -> HardwareProfile:
    """The profile of a CUDA device, read from the driver.

    Bandwidth cannot be read from the driver; it comes from the named profile whose key appears in
    the device name (e.g. "NVIDIA H200"), and is 0.0 for an unknown device; so does the tuning
    (the defaults for an unknown device).
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("hardware.current() needs a CUDA device; use PROFILES[...] instead")
    index = torch.cuda.current_device() if device_index is None else device_index
    props = torch.cuda.get_device_properties(index)
    named = _named_profile_for(props.name)
    return HardwareProfile(
        name=props.name,
        multiprocessors=props.multi_processor_count,
        shared_memory_per_multiprocessor=props.shared_memory_per_multiprocessor,
        l2_bytes=props.L2_cache_size,
        wave_width=props.warp_size,
        registers_per_multiprocessor=getattr(
            props, "regs_per_multiprocessor", (named or PROFILES["h100"]).registers_per_multiprocessor),
        hbm_bandwidth=named.hbm_bandwidth if named else 0.0,
        tuning=named.tuning if named else Tuning(),
        dependent_launch=getattr(props, "major", 0) >= 9,
    )


def profile_for(device) -> HardwareProfile:
    """The profile that plans for tensors on ``device``: the real device for CUDA, else the H200's."""
    if getattr(device, "type", device) == "cuda":
        return current(device.index)
    return PROFILES["h200"]
