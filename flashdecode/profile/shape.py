"""The call a profile runs: a case of the benchmark's matrices by its label, a shape as ``bench
--shapes`` spells it (its own length rule), or a shape given with flags (lengths by the 14 cases'
rule), under one of the benchmark's variants (``cases.VARIANTS``: pages, query tokens, an appended
token)."""
from __future__ import annotations

import argparse
import dataclasses

from .. import cases, planner
from ..problem import DTYPE_BYTES
from ..validate import MAX_HEADDIM
from ..argtypes import positive_int

#: Head dims ``--headdim`` takes (the tuned ones); ``--shape`` takes any the call does.
HEADDIMS = (64, 128, 256)

DTYPES = ("bfloat16", "float16")
SHAPE_FLAGS = ("batch", "seqlen_cache", "nheads_k", "group")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decode call: a case of a matrix (``cases.MATRICES``), or a shape given with flags
    (``case.number`` 0); ``variant`` names one of ``cases.VARIANTS``."""

    case: cases.Case
    headdim: int = cases.HEADDIM
    dtype: str = "bfloat16"
    variant: str = "plain"

    @property
    def label(self) -> str:
        """Short name for directories: ``case12[-paged64]`` or
        ``b8-s32768-hk8-g4[-d64][-uniform][-float16][-q4]``."""
        suffix = "" if self.variant == "plain" else f"-{self.variant}"
        if self.case.number:
            return f"case{self.case.label}{suffix}"
        c = self.case
        extra = ("" if self.headdim == cases.HEADDIM else f"-d{self.headdim}") + \
                ("" if c.lengths == "matrix" else f"-{c.lengths}") + \
                ("" if self.dtype == "bfloat16" else f"-{self.dtype}")
        return f"b{c.batch}-s{c.seqlen_cache}-hk{c.nheads_k}-g{c.group}{extra}{suffix}"

    def describe(self) -> str:
        name = f"case {self.case.label}" if self.case.number else "shape"
        how = "" if self.variant == "plain" else f", {cases.VARIANTS[self.variant].description}"
        return f"{name} ({self.case.describe()}, headdim {self.headdim}, {self.dtype}{how})"

    def problem(self) -> planner.Problem:
        """The Problem ``validate`` makes of :meth:`call`."""
        return cases.VARIANTS[self.variant].problem(dataclasses.replace(self.case, headdim=self.headdim), self.dtype)

    def lengths(self) -> list[int]:
        """Keys each sequence sees (cached and appended)."""
        return self.case.seqlens().tolist()

    def problem_bytes(self) -> int:
        """Bytes the call must move (cases.bytes_read): K and V of the real tokens (1 byte an element
        in an fp8 cache), the appended tokens written, q and out."""
        variant = cases.VARIANTS[self.variant]
        return cases.bytes_read(self.lengths(), self.case.nheads_k, self.case.nheads, self.headdim,
                                DTYPE_BYTES[self.dtype], *variant.token_counts(self.case),
                                cache_element_bytes=1 if variant.cache_dtype else None)

    def argv(self) -> list[str]:
        """The arguments that name this call again (for ``python -m flashdecode.profile.target``)."""
        variant = [] if self.variant == "plain" else ["--variant", self.variant]
        if self.case.number:
            return ["--case", self.case.label, *variant]
        c = self.case
        if c.lengths != "matrix":
            return ["--shape", dataclasses.replace(c, headdim=self.headdim).spelling, "--dtype", self.dtype, *variant]
        return ["--batch", str(c.batch), "--seqlen-cache", str(c.seqlen_cache), "--nheads-k", str(c.nheads_k),
                "--group", str(c.group), "--headdim", str(self.headdim), "--dtype", self.dtype, *variant]

    def call(self, device) -> cases.Call:
        """The call's arguments as ``cases.make_call`` makes them for the benchmark."""
        import torch

        case = dataclasses.replace(self.case, headdim=self.headdim)
        return cases.make_call(case, cases.VARIANTS[self.variant], device, dtype=getattr(torch, self.dtype))


def _ranges() -> str:
    return ", ".join(f"{matrix[0].label}-{matrix[-1].label}" for matrix in cases.MATRICES.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--case LABEL, --shape SPELLING [--dtype], or --batch --seqlen-cache --nheads-k --group [--headdim --dtype]."""
    parser.add_argument("--case", help=f"a case of a matrix: {_ranges()}")
    parser.add_argument("--shape", help="instead of --case: a shape as bench --shapes spells one, batch x "
                                        "seqlen_cache x nheads_k x group x headdim, ':' and its length rule, "
                                        "e.g. 16x2048x1x71x64:uniform")
    for flag in SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=positive_int, help="instead of --case: the shape")
    parser.add_argument("--headdim", type=int, choices=HEADDIMS,
                        help=f"with the shape flags (default {cases.HEADDIM})")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="with the shape flags (default %(default)s)")
    parser.add_argument("--variant", choices=tuple(cases.VARIANTS), default="plain",
                        help="how the case is called: pages, query tokens, an appended token (default %(default)s)")


def from_args(args: argparse.Namespace) -> Shape:
    """The Shape the arguments name; ValueError (a message for the user) when they name none or two."""
    given = [flag for flag in SHAPE_FLAGS if getattr(args, flag) is not None]
    flags = "--batch, --seqlen-cache, --nheads-k and --group"
    if args.case is not None and args.shape is not None:
        raise ValueError("give --case or --shape, not both")
    if args.case is not None or args.shape is not None:
        named = "--case" if args.case is not None else "--shape"
        extra = [f"--{flag.replace('_', '-')}" for flag in given]
        extra += [flag for flag, changed in (("--headdim", args.headdim is not None),
                                             ("--dtype", args.dtype != "bfloat16" and named == "--case")) if changed]
        if extra:
            raise ValueError(f"give {named} or the shape flags, not both: {named} with {', '.join(extra)}")
    if args.shape is not None:
        parsed = cases.parse_shapes(args.shape)
        if len(parsed) != 1:
            raise ValueError(f"--shape takes one shape, got {len(parsed)}: {args.shape!r}")
        case = dataclasses.replace(parsed[0], number=0, matrix="cases")
        if case.headdim > MAX_HEADDIM:
            raise ValueError(f"--shape's head dim must be at most {MAX_HEADDIM}, got {case.headdim}")
        return Shape(case, case.headdim, args.dtype, args.variant)
    if args.case is not None:
        if args.case not in cases.CASES_BY_LABEL:
            raise ValueError(f"unknown case {args.case}: cases are {_ranges()}")
        case = cases.CASES_BY_LABEL[args.case]
        return Shape(case, case.headdim, variant=args.variant)
    if len(given) != len(SHAPE_FLAGS):
        raise ValueError(f"need --case LABEL, --shape SPELLING, or all of {flags}")
    return Shape(cases.Case(0, args.batch, args.seqlen_cache, args.nheads_k, args.group), args.headdim or cases.HEADDIM,
                 args.dtype, args.variant)
