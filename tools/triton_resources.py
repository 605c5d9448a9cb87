"""Registers, stack (spills) and shared memory of Triton's split kernel, compiled for sm_90a on a
machine without a GPU: a first look at a tile config before spending device time on it.

The kernel is compiled by the installed Triton (``triton.compile`` with an explicit target), so the
numbers are that Triton's; the GPU machine's may differ by version. Shapes are plain decode calls
(contiguous cache, one query position) of ``--rows`` query rows per KV head.

Usage: python tools/triton_resources.py --headdim 256 --rows 16,64 [--warps 4,8 --block-n 32,64
       --stages 2,3 --max-registers 0,128 --page-size 16 --batch 32 --kv-heads 8 --dump DIR]
       (each list crossed with the others; empty: the default config's value)
"""
import argparse
import itertools
import os
import pathlib
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashdecode.hardware import PROFILES
from flashdecode.kernels import get_backend
from flashdecode.kernels.base import LaunchArgs
from flashdecode.kernels.triton.backend import padded_headdim, retiled
from flashdecode.kernels.triton.launch import REGISTER_CEILING
from flashdecode.planner import SPLIT, plan
from flashdecode.problem import Problem
from sweep import values  # tools/sweep.py: a comma list of ints, [None] when empty

HOPPER = GPUTarget("cuda", 90, 32)


def plan_launches(problem: Problem, the_plan) -> list:
    """``backend.launches`` of ``the_plan`` for ``problem`` on CPU tensors (a paged problem gets a
    page pool and block table of its capacity; appended tokens, rotary tables and an fp8 cache's
    descales where the problem has them): what to compile, never to run."""
    dtype = getattr(torch, problem.dtype)
    cache_dtype = dtype if problem.cache_dtype is None else getattr(torch, problem.cache_dtype)
    q = torch.empty(problem.batch, problem.seqlen_q, problem.nheads, problem.headdim, dtype=dtype)
    table = None
    if problem.paged:
        pages = problem.seqlen_cache // problem.page_size
        cache = torch.empty(problem.batch * pages, problem.page_size, problem.nheads_k, problem.headdim,
                            dtype=cache_dtype)
        table = torch.empty(problem.batch, pages, dtype=torch.int32)
    else:
        cache = torch.empty(problem.batch, problem.seqlen_cache, problem.nheads_k, problem.headdim, dtype=cache_dtype)
    new = torch.empty(problem.batch, problem.seqlen_new, problem.nheads_k, problem.headdim, dtype=dtype) \
        if problem.seqlen_new else None
    rotary = torch.empty(problem.seqlen_cache, problem.rotary_dim // 2, dtype=dtype) if problem.rotary_dim else None
    descale = torch.empty(problem.batch, problem.nheads_k) if problem.cache_dtype else None
    args = LaunchArgs(q=q, k_cache=cache, v_cache=cache, cache_seqlens=torch.empty(problem.batch, dtype=torch.int32),
                      out=torch.empty_like(q), lse=torch.empty(problem.batch, problem.nheads, problem.seqlen_q),
                      part_o=torch.empty(1, 1, problem.headdim), part_lse=torch.empty(1, 1), softmax_scale=0.1,
                      softcap=1.0, k_new=new, v_new=new, rotary_cos=rotary, rotary_sin=rotary, block_table=table,
                      tickets=torch.zeros(the_plan.ticket_count(problem), dtype=torch.int32), k_descale=descale,
                      v_descale=descale, sinks=torch.empty(problem.nheads) if problem.sinks else None,
                      cu_seqlens_q=torch.empty(problem.batch + 1, dtype=torch.int32) if problem.ragged else None)
    return get_backend("triton").launches(the_plan, problem, args)


def split_launch(problem: Problem, config):
    """(config, kernel, tensors, scalars, constexprs, options) of the split kernel for ``problem``."""
    the_plan = plan(problem, PROFILES["h200"], get_backend("triton"), num_splits=2, config=config)
    kernel, _, tensors, scalars, constexprs, options = plan_launches(problem, the_plan)[0]
    return the_plan.config, kernel, tensors, scalars, constexprs, options


def compile_for_hopper(kernel, tensors, scalars, constexprs, options):
    """The kernel compiled for sm_90a, specialised as Triton's launcher specialises a call with these
    arguments (``native_specialize_impl``): 16-byte-aligned pointers and ints divisible by 16 marked
    so, ints equal to 1 and None made constants, ``do_not_specialize`` respected. Without the marks
    Triton cannot vectorise the loads and the registers read far above a real launch's. ``options``
    are Triton's (a ``REGISTER_CEILING`` is the launcher's business: see ``main``)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    signature, constants, attrs = {}, dict(constexprs), {}
    for index, (param, value) in enumerate(zip(kernel.params, list(tensors) + list(scalars))):
        kind, spec = native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            signature[param.name], constants[param.name] = "constexpr", value
            continue
        signature[param.name] = kind
        if spec:
            attrs[(index,)] = BaseBackend.parse_attr(spec)
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=HOPPER, options=options)


#: The cuobjdump Triton's package carries (absent: no SASS or resource report on this machine).
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cuobjdump(compiled, flag: str) -> str:
    """What ``cuobjdump FLAG`` prints for the compiled kernel's cubin (``-sass``, ``-res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([CUOBJDUMP, flag, cubin.name], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled) -> str:
    """cuobjdump's resource line of the compiled cubin (registers, stack bytes a thread, ...)."""
    report = cuobjdump(compiled, "-res-usage")
    return next((line.strip() for line in report.splitlines() if "REG:" in line), report.strip())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--rows", default="16", help="query rows per KV head (group), comma list")
    # the batch pads into the kernel's specialisation: at batch 4 on 1 KV head the contiguous
    # kernel compiled to 107 registers, at 32 on 8 KV heads to 80, as ncu read case 7 on the H200
    parser.add_argument("--batch", type=int, default=32, help="sequences (default 32, as case 9)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8, as case 9)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--page-size", type=int, default=0, help="a paged cache of pages of this many tokens")
    parser.add_argument("--dump", metavar="DIR", help="also write each kernel's TTGIR and PTX there")
    for flag in ("--warps", "--block-n", "--stages", "--max-registers"):
        parser.add_argument(flag, default="", help="comma list (default: the default config's)")
    args = parser.parse_args()
    backend = get_backend("triton")
    print(f"triton {triton.__version__}, target sm_90a, head dim {args.headdim}, {args.dtype}")
    for rows, warps, block_n, stages, registers in itertools.product(
            values(args.rows), values(args.warps), values(args.block_n), values(args.stages),
            values(args.max_registers)):
        problem = Problem(args.batch, 8192, rows * args.kv_heads, args.kv_heads, args.headdim, args.dtype,
                          page_size=args.page_size, offsets_32=True)
        default = backend.default_config(problem, PROFILES["h200"], SPLIT)
        changes = {name: value for name, value in (("num_warps", warps), ("block_n", block_n),
                                                   ("num_stages", stages)) if value is not None}
        if registers is not None:  # 0: no cap
            changes["max_registers"] = registers or None
        config = retiled(default, padded_headdim(args.headdim), PROFILES["h200"], problem.paged, **changes)
        config, kernel, tensors, scalars, constexprs, options = split_launch(problem, config)
        # as the launcher does (``launch.register_options``): the ceiling only where the compiler exceeds it
        plain = {name: value for name, value in options.items() if name != REGISTER_CEILING}
        compiled = compile_for_hopper(kernel, tensors, scalars, constexprs, plain)
        usage = resource_usage(compiled)
        uncapped = int(re.search(r"REG:(\d+)", usage).group(1))
        if config.max_registers is not None and uncapped > config.max_registers:
            compiled = compile_for_hopper(kernel, tensors, scalars, constexprs, {**plain, "maxnreg": config.max_registers})
            usage = f"{resource_usage(compiled)}  (capped: {uncapped} without the ceiling)"
        if args.dump:
            name = f"rows{rows}-n{config.block_n}-w{config.num_warps}-s{config.num_stages}-p{args.page_size}"
            for kind in ("ttgir", "ptx"):
                pathlib.Path(args.dump, f"{name}.{kind}").write_text(compiled.asm[kind])
        print(f"rows {rows:3d}  block_n {config.block_n:3d}  block_m {config.block_m:3d}  warps {config.num_warps}  "
              f"stages {config.num_stages}  ceiling {config.max_registers}  shared {compiled.metadata.shared:6d}  "
              f"{usage}", flush=True)

if __name__ == "__main__":
    main()
