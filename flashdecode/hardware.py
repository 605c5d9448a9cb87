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
        """Each field of its default's kind: True or False; an int, or a table of ints or of rows
        led by a backend name, whose numbers are at least 1 where a plan divides by them or counts
        programs with them (``_AT_LEAST_ONE``), else at least 0 (0: the rule off); None where the
        default is None. TypeError/ValueError naming the field."""
        for field in dataclasses.fields(self):
            name, value, default = field.name, getattr(self, field.name), field.default
            if name == "auto_order" or value is None and default is None:
                continue
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise TypeError(f"tuning.{name} must be True or False, got {value!r}")
                continue
            table = isinstance(value, tuple) and not isinstance(default, int)
            if table:
                numbers = _table_numbers(name, value)
            elif type(value) is int and not isinstance(default, tuple):
                numbers = [value]
            else:
                kind = "an int" if isinstance(default, int) else "a tuple" if isinstance(default, tuple) else \
                    "an int, a tuple or None"
                raise TypeError(f"tuning.{name} must be {kind}, got {value!r}")
            least = 1 if name in _AT_LEAST_ONE else 0
            for number in numbers:
                if type(number) is not int:
                    raise TypeError(f"tuning.{name} must hold ints, got {value!r}")
                if number < least:
                    rule = f"hold numbers of at least {least}" if table else f"be at least {least}"
                    raise ValueError(f"tuning.{name} must {rule}, got {value!r}")
        if self.underfilled_merge_caps is not None and len(self.underfilled_merge_caps) != 2:
            raise ValueError(f"tuning.underfilled_merge_caps must be (most splits, most partial rows), "
                             f"got {self.underfilled_merge_caps!r}")


#: Tuning's fields whose numbers a plan divides by or counts programs with.
_AT_LEAST_ONE = frozenset(("programs_per_multiprocessor", "min_blocks_per_split", "min_blocks_per_combined_split",
                           "min_blocks_per_one_sequence_split", "triton_tiles", "triton_resident_programs",
                           "triton_paged_resident_programs", "triton_split_32_row_resident_programs"))


def _table_numbers(name: str, table: tuple) -> list:
    """The numbers of Tuning table ``name``: a tuple of ints, or of rows each led by a backend name
    or a head dim; TypeError naming it for another shape."""
    rows = table if any(isinstance(row, tuple) for row in table) else (table,) if table else ()
    if not all(isinstance(row, tuple) and row for row in rows):
        raise TypeError(f"tuning.{name} must be a tuple of ints or of rows (tuples), got {table!r}")
    return [item for row in rows for item in (row[1:] if isinstance(row[0], str) else row)]


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
