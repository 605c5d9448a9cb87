"""SASS counts of the split kernel of bench cases in a variant (default fp8; the H200 plan unless
``--profile`` names another), compiled for sm_90a without a GPU by the installed Triton: registers,
stack, shared memory, and instructions by class in its main loop (the largest loop holding a tensor-core
product: HMMA, or HGMMA/QGMMA for 64-row tiles) /
in the whole kernel. Compiled as the launcher does: again with the register ceiling only where the
kernel exceeds it (CAPPED rows).

Usage: python tools/fp8_sass.py [--cases 7,9,13] [--variant ragged] [--profile h100]
       [--field fp8_v_words --values 0,1] [--dump DIR]
(``--field``: a TritonConfig field set to each of ``--values``)
"""
import argparse
import collections
import dataclasses
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from triton_resources import compile_for_hopper, cuobjdump, plan_launches, resource_usage  # noqa: E402

from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, select  # noqa: E402
from flashdecode.hardware import PROFILES  # noqa: E402
from flashdecode.kernels import get_backend  # noqa: E402
from flashdecode.kernels.triton.backend import TritonConfig  # noqa: E402
from flashdecode.kernels.triton.launch import REGISTER_CEILING  # noqa: E402
from flashdecode.planner import plan  # noqa: E402

#: A tensor-core product: mma.sync (HMMA), or wgmma (HGMMA; QGMMA on fp8 operands) of 64-row tiles.
MMA = r"^(HMMA|[HQ]GMMA)"
CLASSES = [
    ("LDS.U8", r"^LDS\.U8\b|^LDS\.S8\b"), ("LDS.U16", r"^LDS\.U16\b|^LDS\.S16\b"),
    ("LDS.32", r"^LDS(\.U)?(\s|$)|^LDS\.32\b"), ("LDS.64", r"^LDS(\.U)?\.64\b"), ("LDS.128", r"^LDS(\.U)?\.128\b"),
    ("LDSM", r"^LDSM\.16\.M"), ("LDSM.T", r"^LDSM\.16\.MT"), ("STS", r"^STS"), ("LDGSTS", r"^LDGSTS"),
    ("HMMA", r"^HMMA"), ("GMMA", r"^[HQ]GMMA"), ("F2FP", r"^F2FP"), ("F2F", r"^F2F\b|^F2F\."), ("HADD2", r"^HADD2"),
    ("PRMT", r"^PRMT"),
    ("LOP3", r"^LOP3"), ("SHF", r"^SHF"), ("SHFL", r"^SHFL"), ("BAR", r"^BAR"), ("MUFU", r"^MUFU"),
]


def sass_lines(compiled):
    """[(address, opcode text)] of the kernel's SASS (predicates dropped)."""
    out = []
    for line in cuobjdump(compiled, "-sass").splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            text = re.sub(r"^@!?U?P[T0-9]+\s+", "", match.group(2).strip())
            out.append((int(match.group(1), 16), text))
    return out


def main_loop(lines):
    """The lines of the largest loop (a backward branch) holding a tensor-core product (``MMA``)."""
    best = []
    for address, text in lines:
        target = re.search(r"0x([0-9a-f]+)", text) if text.startswith("BRA") else None
        if target is None or int(target.group(1), 16) >= address:
            continue
        body = [line for line in lines if int(target.group(1), 16) <= line[0] <= address]
        if any(re.match(MMA, t) for _, t in body) and len(body) > len(best):
            best = body
    return best


def counts(lines):
    found = collections.Counter()
    for _, text in lines:
        opcode = text.split()[0]
        for name, pattern in CLASSES:
            if re.match(pattern, text):
                found[name] += 1
        if opcode.startswith("LDS") and not any(re.match(p, text) for n, p in CLASSES if n.startswith("LDS")):
            found["LDS.?" + opcode] += 1
    found["total"] = len(lines)
    return found


def compile_case(number, tuning_changes, variant="fp8", profile="h200"):
    case = CASES_BY_NUMBER[number]
    problem = VARIANTS[variant].problem(case)
    backend = get_backend("triton")
    the_plan = plan(problem, PROFILES[profile], backend)
    if tuning_changes:
        the_plan = dataclasses.replace(the_plan, config=dataclasses.replace(the_plan.config, **tuning_changes))
    kernel, _, tensors, scalars, constexprs, options = plan_launches(problem, the_plan)[0]
    plain = {name: value for name, value in options.items() if name != REGISTER_CEILING}
    compiled = compile_for_hopper(kernel, tensors, scalars, constexprs, plain)
    usage = resource_usage(compiled)
    ceiling = options.get(REGISTER_CEILING)
    uncapped = int(re.search(r"REG:(\d+)", usage).group(1))
    capped = None
    if ceiling is not None and uncapped > ceiling:
        capped = compile_for_hopper(kernel, tensors, scalars, constexprs, {**plain, "maxnreg": ceiling})
    return the_plan, compiled, capped, usage


def report(label, compiled, dump=None):
    usage = resource_usage(compiled)
    regs = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    lines = sass_lines(compiled)
    loop = main_loop(lines)
    whole, inner = counts(lines), counts(loop)
    keys = [name for name, _ in CLASSES] + sorted(k for k in set(whole) | set(inner) if k.startswith("LDS.?"))
    cells = " ".join(f"{k}={inner.get(k, 0)}/{whole.get(k, 0)}" for k in keys if whole.get(k, 0) or inner.get(k, 0))
    print(f"{label}: REG {regs} STACK {stack} shared {compiled.metadata.shared}  loop/kernel: "
          f"total={inner['total']}/{whole['total']} {cells}", flush=True)
    if dump:
        pathlib.Path(dump).mkdir(parents=True, exist_ok=True)
        name = label.replace(" ", "_").replace("/", "-")
        pathlib.Path(dump, f"{name}.sass").write_text(cuobjdump(compiled, "-sass"))
        for kind in ("ttgir", "ptx", "llir"):
            pathlib.Path(dump, f"{name}.{kind}").write_text(compiled.asm[kind])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="7,9,13")
    parser.add_argument("--variant", default="fp8", choices=sorted(VARIANTS))
    parser.add_argument("--profile", default="h200", choices=sorted(PROFILES), help="the plan's hardware profile")
    parser.add_argument("--field", default="", help="TritonConfig field to set, e.g. fp8_v_words")
    parser.add_argument("--values", default="", help="its values, comma list (ints)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--dump", default=None)
    args = parser.parse_args()
    try:
        numbers = [int(case.label) for case in select("cases", args.cases)]
    except ValueError as error:
        parser.error(f"--cases: {error}")
    if args.values and not args.field:
        parser.error("--values: the values of --field, which is not given")
    if args.field and (args.field not in {f.name for f in dataclasses.fields(TritonConfig)}
                       or not args.values
                       or not all(v.strip().lstrip("-").isdigit() for v in args.values.split(","))):
        parser.error(f"--field, --values: a TritonConfig field and its integer values, got {args.field!r}, "
                     f"{args.values!r}")
    settings = [{}] if not args.field else [{args.field: int(v)} for v in args.values.split(",")]
    for number in numbers:
        for changes in settings:
            the_plan, compiled, capped, _ = compile_case(number, changes, args.variant, args.profile)
            c = the_plan.config
            label = (f"{args.tag}case{number} {args.variant} {changes or ''} n{c.block_n} m{c.block_m} w{c.num_warps} "
                     f"s{c.num_stages} cap{c.max_registers}").replace("{", "").replace("}", "").replace("'", "")
            report(label, compiled, args.dump)
            if capped is not None:
                report(label + " CAPPED", capped, args.dump)


if __name__ == "__main__":
    main()
