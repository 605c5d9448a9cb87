"""The PTX of the Triton kernels that plans launch, compiled for sm_90a on a machine without a GPU:
whether a source change leaves the shipped kernels as they were.

For each problem below (the planner's own plan on the H200 profile) every launch of the plan is
compiled (``triton_resources.compile_for_hopper``) and its PTX written to DIR without what only
locates source lines (``.loc``, ``.file``, debug labels and sections), so two trees compare equal
when they compile to the same instructions. Run it on each tree, then compare:

Usage: python tools/triton_ptx.py DIR                  # write DIR/<problem>-<launch>.ptx
       python tools/triton_ptx.py DIR --compare OTHER  # and say which differ from OTHER's (exit 1 if any)
The kernels compiled are those of the tree this script lies in (its folder's parent goes first on
the import path, ahead of an installed flashdecode): run each tree's own copy.
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flashdecode.problem import Problem  # noqa: E402

#: Plans of every kernel kind: single passes (cases 1 and 5, short caches at head dims 59-64, a
#: full grid), splits merged in the kernel and combined (case 7, case 10, one sequence at a padded
#: head dim: the combine's chunks), 4 query rows, pages, sinks.
PROBLEMS = {
    "case1": Problem(1, 1, 32, 4, 128, "bfloat16"),
    "case5": Problem(16, 141, 32, 4, 128, "bfloat16"),
    "case7": Problem(64, 2048, 32, 8, 128, "bfloat16"),
    "case10": Problem(1, 8192, 32, 4, 128, "bfloat16"),
    "short-d64": Problem(8, 300, 16, 2, 64, "float16"),
    "full-grid": Problem(256, 256, 64, 8, 128, "bfloat16"),
    "one-sequence-d80": Problem(1, 8192, 8, 2, 80, "float16"),
    "batch-d59": Problem(2, 16384, 8, 2, 59, "float16"),
    "q4-d96": Problem(4, 2048, 16, 4, 96, "bfloat16", seqlen_q=4),
    "merge-d80": Problem(16, 4096, 32, 8, 80, "bfloat16"),
    "pages16": Problem(16, 4096, 32, 8, 128, "bfloat16", page_size=16, offsets_32=True),
    "pages256": Problem(16, 4096, 32, 8, 128, "bfloat16", page_size=256),
    # fp8 caches: contiguous with V read as words, paged
    "case9-fp8": Problem(32, 4096, 32, 8, 128, "bfloat16", cache_dtype="float8_e4m3fn"),
    "pages16-fp8": Problem(16, 4096, 32, 8, 128, "float16", page_size=16, offsets_32=True,
                           cache_dtype="float8_e4m3fn"),
    # sinks: folded in one pass, in the split kernel's merge, and by the combine
    "case1-sinks": Problem(1, 1, 32, 4, 128, "bfloat16", sinks=True),
    "case7-sinks": Problem(64, 2048, 32, 8, 128, "bfloat16", sinks=True),
    "case10-sinks": Problem(1, 8192, 32, 4, 128, "bfloat16", sinks=True),
}
#: Line starts that only say where an instruction came from.
LOCATORS = (".loc", ".file", "$L__info", "$L__tmp", "//")


def instructions(ptx: str) -> str:
    """``ptx`` without its debug sections and the lines that only locate source."""
    return "\n".join(line for line in ptx.split("\t.section\t.debug")[0].splitlines()
                     if not line.strip().startswith(LOCATORS)) + "\n"


def write(folder: pathlib.Path) -> list[str]:
    """Compile every launch of every problem's plan; write its instructions; return the file names."""
    from triton_resources import compile_for_hopper, plan_launches

    from flashdecode.hardware import PROFILES
    from flashdecode.kernels import get_backend
    from flashdecode.kernels.triton.launch import _without_ceiling
    from flashdecode.planner import plan

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for label, problem in PROBLEMS.items():
        the_plan = plan(problem, PROFILES["h200"], get_backend("triton"))
        for index, (kernel, _, tensors, scalars, constexprs, options) in enumerate(plan_launches(problem, the_plan)):
            compiled = compile_for_hopper(kernel, tensors, scalars, constexprs, _without_ceiling(options))
            names.append(f"{label}-{index}.ptx")
            (folder / names[-1]).write_text(instructions(compiled.asm["ptx"]))
    return names


def compare(folder: pathlib.Path, other: pathlib.Path, pattern: str = "*.ptx") -> dict:
    """{file name: "same", "differs", or which folder alone has it} over both folders' files that
    match ``pattern`` (``tilelang_source.py`` compares its CUDA sources with it)."""
    names = sorted({path.name for path in folder.glob(pattern)} | {path.name for path in other.glob(pattern)})
    verdicts = {}
    for name in names:
        mine, theirs = folder / name, other / name
        if not (mine.exists() and theirs.exists()):
            verdicts[name] = f"only in {folder if mine.exists() else other}"
        else:
            verdicts[name] = "same" if mine.read_text() == theirs.read_text() else "differs"
    return verdicts


def print_comparison(folder: pathlib.Path, other: pathlib.Path, pattern: str = "*.ptx") -> int:
    """Print ``compare``'s verdicts; the exit status: 0 when every file is the same, 1 otherwise
    (and where ``other`` is no folder: nothing compared)."""
    if not other.is_dir():
        print(f"--compare: no folder at {other}", file=sys.stderr)
        return 1
    verdicts = compare(folder, other, pattern)
    for name, verdict in verdicts.items():
        print(f"{name}: {verdict}")
    return 0 if all(verdict == "same" for verdict in verdicts.values()) else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--compare", type=pathlib.Path, default=None, help="a folder an earlier run wrote")
    args = parser.parse_args()
    if args.folder.exists() and not args.folder.is_dir():
        parser.error(f"{args.folder} is a file; name a folder")
    names = write(args.folder)
    if args.compare is None:
        print("\n".join(names))
        return 0
    return print_comparison(args.folder, args.compare)


if __name__ == "__main__":
    sys.exit(main())
