"""Tuning sweep on the GPU machine: each case under every combination of the given tuning values
and tile configs, timed from a CUDA graph (cold L2) and checked against the reference; each row
logs the plan that ran.

Variants are values given to a ``DecodeContext(tuning=..., config=...)``; nothing is reassigned.
Usage: python tools/sweep.py --backend tilelang,triton --ppsm 2,3,4 --block-n 32,64
       [--tl-stages 2,3 --tl-rows 64,16 --tl-producer-regs 24,0 --warps 4,8 --max-registers 0,128
       --merge-splits 0,16 --fp8-v-words 0,1 --pack-heads 1,2] [--matrix wide] [--cases 7,12]
       [--shapes 64x4096x8x4x256:uniform,...] [--variant plain,paged256] [--q-dtype bfloat16,float16]
       [--log FILE]
``--min-chunk`` sets the fewest blocks per split, whatever merges the splits (both Tuning fields; one
sequence on a backend with ``min_blocks_per_one_sequence_split`` and the short caches split for idle
multiprocessors take their own, shorter ones); ``--one-sequence-min-blocks`` sets one sequence's
(0: none, the batch rules apply); ``--split-above`` ``split_above_blocks`` (the most blocks a cache
has unsplit, unless ``underfilled_split_above_blocks`` splits it: at or below its count, that rule is off);
``--underfilled-above`` that count for the backend (0: the rule off);
``--tl-stages`` and ``--tl-rows`` set any backend's ``num_stages`` / ``block_m`` (a swept tile starts
from the case's planned config: without ``--tl-stages`` it keeps that plan's pipeline depth, which
``Backend.for_grid`` chose for the default tile, not for the swept one); ``--warps`` Triton's
``num_warps``; ``--max-registers`` Triton's register cap (0: none; -1: the shipped rule's for the tile);
``--fp8-v-words 0,1`` Triton's ``fp8_v_words`` (fp8 caches: V read as 16-bit words, not byte by byte;
without it a swept Triton tile is steered off Triton's miscompiles as the default is, ``workarounds.steer``);
``--pack-heads 1,2`` times the call with that many adjacent KV heads viewed as one (``pack_heads``: a
kernel experiment, the output checked after unpacking; no appended tokens or ragged rows);
``--combine-step`` and ``--combine-dims`` Triton's combine: partials a program loads at once, head
dims it merges (0: the whole head); ``--merge-splits`` the most splits a sequence may have for the
split kernel to merge them itself (0: never); ``--dependent-combine 0,1`` the combine as a
programmatic dependent launch; ``--triton-resident`` the split programs Triton assumes an SM
holds at the case's head dim (the row of ``Tuning.triton_resident_programs`` it takes, for paged
caches and 32-row tiles too: single-sequence grids and the register cap follow); ``--underfilled-caps 8:256,none``
``Tuning.underfilled_merge_caps`` (none: that rule off; ``--min-chunk`` sets the combine's minimum
too, and at equal minimums the rule has no shorter split to take). ``--shapes`` adds cases of one's own:
batch x seqlen_cache x nheads_k x group x headdim, then ``:`` and a length rule of ``cases.LENGTH_RULES``
(``cases.parse_shapes``: S1, S2, ...).
"""
import argparse
import dataclasses
import itertools
import json

import torch

from flashdecode import DecodeContext, flash_attn_with_kvcache, plan_for
from flashdecode.bench.timing import Timer
from flashdecode.cases import MATRICES, VARIANTS, make_call, parse_shapes, select
from flashdecode.hardware import current
from flashdecode.kernels.triton.backend import TritonConfig, padded_headdim, retiled, split_32_row_resident
from flashdecode.kernels.triton.workarounds import steer
from flashdecode.reference import reference_attention, relative_error
from flashdecode.validate import MAX_HEADDIM


def values(text):
    return [int(item) for item in text.split(",")] if text else [None]


def caps(text):
    """``--underfilled-caps``: SPLITS:ROWS items, or none (no underfilled rule); [None]: the measured value."""
    if not text:
        return [None]
    return [() if item == "none" else tuple(int(part) for part in item.split(":")) for item in text.split(",")]


def pack_heads(inputs, heads: int):
    """(q, k_cache, v_cache, kwargs, unpack) of the case's call with ``heads`` adjacent KV heads as
    one head of ``heads`` x headdim (``--pack-heads``): the caches viewed so, each query head padded
    to that width with zeros outside its own KV head's dims, so a row scores only its own head, at
    the scale of the real head dim; ``unpack`` takes each query head's own dims of the output. It
    asks the split kernel what a tile of several KV heads would cost, without a kernel change."""
    kwargs = inputs.kwargs()
    if heads == 1:
        return inputs.q, inputs.k_cache, inputs.v_cache, kwargs, lambda out: out
    nheads, headdim = inputs.q.shape[-2:]
    nheads_k = inputs.k_cache.shape[-2]
    if nheads_k % heads or heads * headdim > MAX_HEADDIM or inputs.k is not None or inputs.cu_seqlens_q is not None:
        raise ValueError(f"--pack-heads {heads}: needs KV heads in multiples of it, {heads} x the head dim at most "
                         f"{MAX_HEADDIM}, no appended tokens, no ragged rows")
    own = torch.arange(nheads, device=inputs.q.device) // (nheads // nheads_k) % heads  # place in its packed head
    spread = torch.nn.functional.one_hot(own, heads).to(inputs.q.dtype)[:, :, None]  # (nheads, heads, 1)
    q = (inputs.q.unsqueeze(-2) * spread).flatten(-2)
    k_cache, v_cache = (cache.unflatten(-2, (nheads_k // heads, heads)).flatten(-2)
                        for cache in (inputs.k_cache, inputs.v_cache))
    for name in ("k_descale", "v_descale"):  # one descale per packed head: the group's must agree
        if name in kwargs:
            grouped = kwargs[name].unflatten(-1, (nheads_k // heads, heads))
            if not torch.equal(grouped, grouped[..., :1].expand_as(grouped)):
                raise ValueError(f"--pack-heads {heads}: {name} differs within a packed head")
            kwargs[name] = grouped[..., 0].contiguous()
    kwargs["softmax_scale"] = headdim ** -0.5
    heads_index = torch.arange(nheads, device=inputs.q.device)
    return q, k_cache, v_cache, kwargs, lambda out: out.unflatten(-1, (heads, headdim))[..., heads_index, own, :]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="tilelang")
    for flag in ("--ppsm", "--min-chunk", "--short-max-blocks", "--block-n", "--tl-stages", "--tl-rows",
                 "--tl-producer-regs", "--warps", "--max-registers", "--merge-splits",
                 "--dependent-combine", "--triton-resident", "--one-sequence-min-blocks", "--split-above",
                 "--underfilled-above", "--combine-step", "--combine-dims", "--fp8-v-words"):
        parser.add_argument(flag, default="", help="comma list (default: the measured value)")
    parser.add_argument("--pack-heads", default="", help="comma list: adjacent KV heads viewed as one (default: 1)")
    parser.add_argument("--underfilled-caps", default="", help="comma list of SPLITS:ROWS or none "
                        "(Tuning.underfilled_merge_caps; default: the measured value)")
    parser.add_argument("--matrix", default="cases", choices=sorted(MATRICES))
    parser.add_argument("--cases", default="", help="cases of the matrix, e.g. 7,12 or W9,W10 (default: all; none "
                        "with --shapes)")
    parser.add_argument("--shapes", default="")
    parser.add_argument("--variant", default="plain", help="comma list of cases.VARIANTS (default: plain)")
    parser.add_argument("--q-dtype", default="bfloat16", help="comma list of bfloat16, float16: the call's dtype "
                        "(q, k/v and the cache; an fp8 variant's cache stays fp8; default: bfloat16)")
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    chosen = select(args.matrix, args.cases) if args.cases else () if args.shapes else MATRICES[args.matrix]
    try:
        cases = list(chosen) + list(parse_shapes(args.shapes))
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    if set(args.q_dtype.split(",")) - {"bfloat16", "float16"}:
        parser.error(f"--q-dtype takes bfloat16 and float16, got {args.q_dtype!r}")
    timer = Timer(torch.device("cuda"), iters=50, warmup=5)
    base = current().tuning
    rows = []
    for case, variant, q_dtype, pack in itertools.product(cases, args.variant.split(","), args.q_dtype.split(","),
                                                          values(args.pack_heads)):
        pack = pack or 1  # no --pack-heads: each KV head its own
        inputs = make_call(case, VARIANTS[variant], device="cuda", dtype=getattr(torch, q_dtype))
        expected = reference_attention(inputs.q, inputs.k_cache, inputs.v_cache, **inputs.kwargs())[0]
        nbytes = inputs.bytes_moved()
        try:
            q, k_cache, v_cache, kwargs, unpack = pack_heads(inputs, pack)
        except ValueError as failure:
            print(json.dumps(dict(case=case.label, variant=variant, pack_heads=pack, error=str(failure))), flush=True)
            continue
        headdim = padded_headdim(q.shape[-1])
        # the row of Tuning.triton_resident_programs the case's head dim takes (``--triton-resident``)
        resident_row = next((dim for dim, _ in base.triton_resident_programs if dim >= headdim),
                            base.triton_resident_programs[-1][0])
        for backend, ppsm, min_chunk, short_max, block_n, stages, q_rows, producer, warps, registers, merge, \
                dependent, resident, one_sequence, split_above, underfilled, combine_step, combine_dims, fp8_v_words, \
                underfilled_caps in itertools.product(
                    args.backend.split(","), *(values(getattr(args, name)) for name in (
                        "ppsm", "min_chunk", "short_max_blocks", "block_n", "tl_stages", "tl_rows",
                        "tl_producer_regs", "warps", "max_registers", "merge_splits",
                        "dependent_combine", "triton_resident", "one_sequence_min_blocks", "split_above",
                        "underfilled_above", "combine_step", "combine_dims", "fp8_v_words")),
                    caps(args.underfilled_caps)):
            tuning = dataclasses.replace(base, **{name: value for name, value in (
                ("programs_per_multiprocessor", ppsm), ("min_blocks_per_split", min_chunk),
                ("min_blocks_per_combined_split", None if min_chunk is None else ((backend, min_chunk),)),
                ("short_cache_max_blocks", short_max), ("max_splits_merged_in_split", merge),
                ("dependent_combine", None if dependent is None else bool(dependent)),
                ("triton_resident_programs", None if resident is None else tuple(
                    (dim, resident if dim == resident_row else programs)
                    for dim, programs in base.triton_resident_programs)),
                ("triton_paged_resident_programs", None if resident is None else ()),
                ("triton_split_32_row_resident_programs", None if resident is None else ()),
                ("min_blocks_per_one_sequence_split",
                 None if one_sequence is None else ((backend, one_sequence),) if one_sequence else ()),
                ("split_above_blocks", split_above),
                ("underfilled_split_above_blocks",
                 None if underfilled is None else ((backend, underfilled),) if underfilled else ()))
                if value is not None})
            if underfilled_caps is not None:  # () is none: the rule off
                tuning = dataclasses.replace(tuning, underfilled_merge_caps=underfilled_caps or None)
            resolved = plan_for(q, k_cache, v_cache, **kwargs, backend=backend,
                                context=DecodeContext("cuda", tuning=tuning))
            default = resolved.plan.config
            changes = {name: value for name, value in (("block_n", block_n), ("num_stages", stages),
                                                       ("block_m", q_rows), ("producer_registers", producer),
                                                       ("num_warps", warps), ("combine_step", combine_step),
                                                       ("combine_dims", combine_dims or None),
                                                       ("fp8_v_words",
                                                        None if fp8_v_words is None else bool(fp8_v_words)))
                       if value is not None and hasattr(default, name)}
            if registers is not None and registers >= 0 and isinstance(default, TritonConfig):  # 0: no cap
                changes["max_registers"] = registers or None
            if isinstance(default, TritonConfig):  # the swept tile's register ceiling, not the default's
                profile, problem = dataclasses.replace(current(), tuning=tuning), resolved.problem
                swept = dataclasses.replace(default, **changes)  # its grid, as the planner would cap it
                grid = plan_for(q, k_cache, v_cache, **kwargs, backend=backend,
                                context=DecodeContext("cuda", tuning=tuning, config=swept)).plan
                resident = split_32_row_resident(problem, grid.kernel, swept, profile, grid.working_grid(problem),
                                                 grid.most_blocks_per_program(problem))
                config = retiled(default, headdim, profile, inputs.block_table is not None, resident, **changes)
                if fp8_v_words is None:  # a swept tile off Triton's miscompiles, as the default is
                    config = steer(resolved.problem, config, headdim)
            else:
                config = dataclasses.replace(default, **changes)
            row = dict(case=case.label, shape=case.describe(), variant=variant, q_dtype=q_dtype, pack_heads=pack,
                       backend=backend, tuning=dataclasses.asdict(tuning), config=changes,
                       effective=dataclasses.asdict(config))
            try:  # a combination the compiler rejects is logged, the sweep goes on
                context = DecodeContext("cuda", tuning=tuning, config=config)
                chosen = plan_for(q, k_cache, v_cache, **kwargs, backend=backend, context=context).plan
                row["plan"] = dict(kernel=chosen.kernel, programs_per_head=chosen.programs_per_head,
                                   merge_in_split=chosen.merge_in_split, dependent_combine=chosen.dependent_combine,
                                   min_chunk=chosen.min_chunk)

                def call():
                    return flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs, backend=backend, context=context)

                error = relative_error(unpack(call()), expected)
                timing, graph_out = timer.time_graph(call)
                error = max(error, relative_error(unpack(graph_out), expected))
                row.update(us=round(timing.median_us, 2), gbps=round(nbytes / timing.median_us / 1e3), rel_err=error)
            except Exception as failure:  # noqa: BLE001
                row["error"] = f"{type(failure).__name__}: {str(failure).splitlines()[-1][:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.log:
        with open(args.log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
