"""Hardware profiles: the only place in flashdecode where hardware numbers live.

The planner sizes its grid and tiles from a :class:`HardwareProfile` and takes its thresholds from
the profile's :class:`Tuning`; the benchmark sizes its L2 flush from it. ``current()`` reads the
CUDA device in use; ``PROFILES`` holds named profiles so plans can be computed and tested on a
machine without that device.

Sources of the named numbers (see docs/hardware.md):
- H100 SXM and H200: NVIDIA datasheets (SMs, shared memory, bandwidth); L2 as PyTorch reports it
  on the H200 this project measures on (60 MiB), 50 MiB for the H100.
- MetaX C500: the vendor's figures as given in this project's brief (104 compute units, wave64,
  64 KiB shared memory per unit, 8 MiB L2, about 1.8 TB/s). Its register file size is not in
  that brief: 64 Ki registers per unit is an assumption (the NVIDIA figure), to be checked.
- Registers: 64 Ki 32-bit registers per SM on Hopper (CUDA programming guide).
- Tuning: measured on the H200 (``docs/design.md``, "Measured choices", cites each measurement).
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
    #: (``Backend.pipelined``; ``kernels.base.select`` asks the planner)
    not_pipelined_by: tuple[str, ...] = ()

    def admits(self, problem) -> bool:
        """Whether this rule's limits hold for ``problem`` (a :class:`~flashdecode.problem.Problem`)."""
        return ((self.max_cache_bytes is None or problem.cache_bytes() < self.max_cache_bytes)
                and (self.max_headdim is None or problem.headdim <= self.max_headdim)
                and not (self.plain_cache_only and (problem.paged or problem.seqlen_new > 0)))


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The schedule's thresholds and the ``auto`` rule, measured per device (``docs/design.md``,
    "Measured choices"): values, never reassigned; a sweep passes another Tuning."""

    #: Programs aimed for per multiprocessor when a batch splits (3: one wave of finer programs
    #: balanced mixed lengths best on cases 7-14).
    programs_per_multiprocessor: int = 3
    #: Fewest KV blocks a split carries (unless its sequence is shorter) where the split kernel merges
    #: the splits: 2 would let a sequence get more than ``max_splits_merged_in_split`` and cost the
    #: merge (H200, Triton: cases 8 and 9 1.5-8% slower); an underfilled batch's exception:
    #: ``underfilled_merge_caps``.
    min_blocks_per_split: int = 4
    #: The same where the combine merges them, and for underfilled batches (``underfilled_merge_caps``),
    #: by backend name (others: ``min_blocks_per_split``); none where not measured. Hopper: ``HOPPER_TUNING``.
    min_blocks_per_combined_split: tuple[tuple[str, int], ...] = ()
    #: The same for a batch of one sequence, by backend name (none: the rules above), however its
    #: splits are merged: with nothing else running, a program's serial blocks are the call's
    #: latency, and every shorter split adds programs that run at once. Hopper: ``HOPPER_TUNING``.
    min_blocks_per_one_sequence_split: tuple[tuple[str, int], ...] = ()
    #: Caches of at most this many KV blocks are not split (but see the next field): a combine
    #: costs more than it saves.
    split_above_blocks: int = 8
    #: By backend name (none: ``split_above_blocks`` alone): caches of more than this many blocks
    #: (and at most ``split_above_blocks``) split into 1-block programs where unsplit they would
    #: launch fewer programs (batch * KV heads * row tiles) than the device has multiprocessors:
    #: a pass over a few blocks waits on memory once a block, so idle multiprocessors are latency
    #: saved. Hopper: ``HOPPER_TUNING``.
    underfilled_split_above_blocks: tuple[tuple[str, int], ...] = ()
    #: Unsplit caches of at most this many tiles take a backend's short-cache kernel (3 tiles: 16%
    #: faster than the pipeline on case 5; 6 tiles: 9% slower on case 6; 4: paged caches of one
    #: 256-token page holding 1-141 tokens 1.4-2.2x faster, contiguous cases 1-6 unchanged).
    short_cache_max_blocks: int = 4
    #: Split plans whose sequences get at most this many splits merge them in the split kernel
    #: (``Plan.merge_in_split``: one launch) where the backend can; 0: never, the default for devices
    #: where it was not measured (its ordering of partials through a GPU-scope atomic is checked on
    #: NVIDIA's only). Hopper: ``HOPPER_TUNING``.
    max_splits_merged_in_split: int = 0
    #: The partial rows a merging program may read: split plans merge in the split kernel only where
    #: the most splits a sequence can get times the row tile is at most this too; None: no such
    #: limit (devices where it was not measured). Hopper: 512, i.e. 16 splits of tiles up to 32
    #: rows, 8 of 64-row tiles (H200, Triton, 16 splits merged against combined: 4 x 8192 tokens at
    #: group 71 27.8 against 17.0 us, with 4 query tokens 34.2 against 26.0, 16 x 4096 at group 16
    #: with 4 query tokens 40.7 against 40.3; 32-row tiles merge faster: case 8 with 4 query tokens
    #: 47.9 against 50.7, 32 x 4096 at group 8 with 4 query tokens 64.8 against 73.3).
    max_rows_merged_in_split: int | None = None
    #: (most splits, most partial rows) merged in the split kernel where a batch's grid is
    #: underfilled (``Plan.min_chunk_binds``: the fewest blocks a split carries, not the keys spread
    #: over the grid, sets every split's length): such plans take the combine's shorter minimum
    #: (``min_blocks_per_combined_split``) and merge them only within these caps (and the caps above),
    #: since with every split running at once the merge is the call's exposed tail;
    #: None: the caps above, at ``min_blocks_per_split``. Hopper: (8, 256), measured on the H200 with
    #: Triton on 16 shapes of that class (``docs/design.md``, "The schedule"): GPU time 0.925x
    #: (geometric mean; one of 32 rows 10% slower), the eager loop 0.919x; the combine for all of them
    #: cost the smallest calls their eager time (two launches' host time above their GPU time).
    underfilled_merge_caps: tuple[int, int] | None = None
    #: Split plans that keep a combine launch it as a programmatic dependent launch (Hopper and
    #: later: it is scheduled while the split kernel drains and waits in the kernel for the
    #: partials; ``Plan.dependent_combine``) where the backend can; off where not measured.
    dependent_combine: bool = False
    #: ``auto``'s order (:class:`AutoRule`): the first rule whose limits hold and whose backend can
    #: take the call runs it. Measured on the H200 with both on the compiled host path
    #: (``docs/design.md``, "Measured choices"): TileLang below 32 MiB for contiguous caches that
    #: neither backend's plan splits nor Triton's pipelines deeper, without appended tokens (cases 1-4,
    #: 32-token caches: its short-cache and 64-row kernels up to 8% faster; where Triton's plan takes
    #: 4 stages, 3-4-block caches, Triton is 12-20% faster, case 5 9.7 against 11.0 us); split caches
    #: go to Triton's split kernel, 2-17% faster (case 10, one or two sequences of 1k-33k tokens);
    #: Triton for paged caches and appended tokens there (4-49% less
    #: GPU time on cases 5, 6 and 10 and case 4's append; case 4's pages and cases 1-3 within 1.3
    #: us); above 32 MiB Triton's split kernel at head dims 64-128 (plain calls: 1-28% less GPU time
    #: on cases 7-9 and 11-14, wide W1-W8, W11, W12, W14); at head dim 256 a tie, TileLang kept (2%
    #: faster on W9 and a shape of our own, 0-3% slower on W10 and two others in the sweep).
    auto_order: tuple = (AutoRule("tilelang", max_cache_bytes=32 * MIB, plain_cache_only=True,
                                  unsplit_by=("tilelang", "triton"), not_pipelined_by=("triton",)),
                         AutoRule("triton", max_headdim=128), AutoRule("tilelang"), AutoRule("triton"))
    #: Triton's split-kernel tile by padded head dim (at most): (head dim, block_n, num_warps,
    #: num_stages). Swept on the H200 (``docs/design.md``, "Measured choices"): 128 tokens at head dim
    #: 64 (W8, W14 4-9% faster than 64), 4 warps and 3 stages of 64 tokens at 256 (W9, W10 and two
    #: shapes of our own 10-25% faster than 8 warps on 32); head dims up to 32 keep 64 tokens (not swept).
    triton_tiles: tuple = ((32, 64, 4, 2), (64, 128, 4, 2), (128, 64, 4, 2), (256, 64, 4, 3))
    #: Pipeline stages of Triton's kernels where the grid leaves shared memory over
    #: (``TritonBackend.pipelined``; 0: the tile table's always). Hopper: 4, measured on the H200
    #: (graph us, 2 / 4 / 7 stages): 16 x 141 tokens on 4 KV heads (64 programs of 3 blocks) 11.4 /
    #: 10.0 / 10.0, 4 x 256 on 8 (32 of 4) 13.0 / 10.9 / 11.2, 32 x 256 on 4 (128 of 4) 14.1 / 12.3 /
    #: 12.4; where 512 programs fill the device 19.7 / 21.2 / 26.3 (64 x 200 on 8); programs of at most
    #: 2 blocks keep the table's (3 stages: case 10 16.7 -> 17.9).
    triton_pipelined_stages: int = 0
    #: Split programs of Triton's kernel one SM holds, by head dim (ncu, head dim 128: 38 KB of shared
    #: memory, 107 registers x 128 threads; 256: its 3 stages of 64 tokens keep 128 KB of shared memory).
    triton_resident_programs: tuple = ((64, 4), (128, 4), (256, 1))
    #: The same table for paged caches, where measured (empty: ``triton_resident_programs``); the
    #: register cap aims at it. Hopper: ``HOPPER_TUNING``.
    triton_paged_resident_programs: tuple = ()


#: Hopper's tuning (``docs/design.md``, "The schedule"), on the H200 with Triton: the merge in the
#: split kernel up to 16 splits a sequence (cases 7-9 1-9% less GPU time; 64 merged single sequences
#: of 32-50 splits too, cases 10 and 13 7-50% slower), a dependent combine above (case 10's eager
#: loop 21.0 -> 15.7 us a call), and splits down to 2 blocks where Triton keeps a combine: more,
#: shorter programs where the keys are few for the grid (case 10 128 -> 256 programs, 18.1 -> 16.1
#: us; one sequence of 4096 tokens 18.4 -> 14.3 us). TileLang keeps 4 there: its programs cost more
#: to start (case 10 20.0 -> 21.6 us at 2). Triton's paged kernel at head dim 128 is capped at 96
#: registers, so that 5 programs fit an SM as for the contiguous kernel (80 registers; shared memory
#: allows 5), not 4 (its 104-112 registers): case 7 with pages of 16 122.9 -> 110.9 us, of 64 119.4
#: -> 110.1; cases 8 and 9 lose 2-4% to the cap's spills. One sequence in Triton's splits of 1
#: block: 1024 tokens on 8 KV heads 16.2 -> 12.6 us graph, 11.9 -> 9.8 an eager call (merged in the
#: kernel; the combine's second launch gave 11.2 graph but 14.2 eager). Triton splits caches of 5-8
#: blocks where they would leave multiprocessors idle, and so ``auto`` (which gives TileLang only the
#: short caches no plan splits nor pipelines deeper) runs them on Triton: 512 tokens on 8 KV heads
#: took 11.3 us in 1-block splits against 19.2 in
#: Triton's single pass and 15.3 in TileLang's, two such sequences 12.6 against 20.0 and 15.3,
#: sixteen of 362 tokens (128 programs) 18.7 against 20.0 and 18.7; TileLang's own splits lost on
#: six of those eight shapes (by up to 44%), and Triton's where 2048 programs fill the device (W14
#: +3.4%) (``docs/design.md``, "Measured choices"). Batches whose grid the 4-block minimum leaves
#: underfilled take a 2-block minimum, merged up to 8 splits of 256 partial rows, else combined
#: (``underfilled_merge_caps``).
HOPPER_TUNING = Tuning(max_splits_merged_in_split=16, max_rows_merged_in_split=512, dependent_combine=True,
                       underfilled_merge_caps=(8, 256),
                       min_blocks_per_combined_split=(("triton", 2),),
                       min_blocks_per_one_sequence_split=(("triton", 1),),
                       underfilled_split_above_blocks=(("triton", 4),), triton_pipelined_stages=4,
                       triton_paged_resident_programs=((64, 4), (128, 5), (256, 1)))


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
