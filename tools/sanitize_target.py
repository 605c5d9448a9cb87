"""A small workload for compute-sanitizer: one backend (``--backend``, default TileLang) on a few
shapes that cover one program per sequence, balanced splits (Triton: case 10's combine as a
dependent launch), forced splits (Triton: merged in the split kernel), empty rows, lengths at block
boundaries in the split kernel (case 6) and the short-cache kernel (cases 3, 4: one tile; case 5:
three; Triton's 4-stage single pass there), a split plan of 4-block programs (Triton: 4 stages,
merged in the split kernel), tiles gathered from pages of 16 by both, and repeat calls that the
compiled host path launches (its out and lse allocated by the extension), checked against the first."""
import argparse

import torch

from flashdecode import flash_attn_with_kvcache, flash_decode_with_kvcache
from flashdecode.cases import CASES_BY_NUMBER, VARIANTS, make_call, make_inputs, parse_shapes
from flashdecode.context import default_context

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--backend", default="tilelang")
backend = parser.parse_args().backend

for number in (3, 4, 5, 10):
    q, k, v, seqlens = make_inputs(CASES_BY_NUMBER[number], device="cuda")
    for num_splits in (0, 3):
        flash_decode_with_kvcache(q, k, v, seqlens, num_splits=num_splits, backend=backend)
q, k, v, _ = make_inputs(CASES_BY_NUMBER[5], device="cuda")
seqlens = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129, 141, 0, 2, 3, 4, 5, 6, 7], dtype=torch.int32, device="cuda")
flash_decode_with_kvcache(q, k, v, seqlens, backend=backend)
q, k, v, _ = make_inputs(CASES_BY_NUMBER[6], device="cuda")  # 16 x 362 tokens: split kernel, unsplit
seqlens = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 361, 362], dtype=torch.int32,
                       device="cuda")
flash_decode_with_kvcache(q, k, v, seqlens, backend=backend)
q, k, v, _ = make_inputs(CASES_BY_NUMBER[4], device="cuda")  # 64 x 64 tokens: one tile
seqlens = torch.tensor([0, 1, 2, 17, 31, 32, 33, 63, 64] * 7 + [0], dtype=torch.int32, device="cuda")
flash_decode_with_kvcache(q, k, v, seqlens, backend=backend)
q, k, v, _ = make_inputs(parse_shapes("8x1000x2x16x128:uniform")[0], device="cuda")  # 4-block split programs
seqlens = torch.tensor([0, 1, 255, 256, 257, 999, 1000, 640], dtype=torch.int32, device="cuda")
flash_decode_with_kvcache(q, k, v, seqlens, backend=backend)
for number, lengths in ((6, [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 361, 362]),
                        (5, [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 140, 141, 2, 3, 4])):
    call = make_call(CASES_BY_NUMBER[number], VARIANTS["paged16"], device="cuda")
    call.cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    for num_splits in (0, 3):
        flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, **call.kwargs(), num_splits=num_splits,
                                backend=backend)
for number in (3, 6, 10):  # the first call records its launches; the repeats are the compiled host path's
    q, k, v, seqlens = make_inputs(CASES_BY_NUMBER[number], device="cuda")
    first = flash_decode_with_kvcache(q, k, v, seqlens, return_softmax_lse=True, backend=backend)
    for _ in range(3):
        again = flash_decode_with_kvcache(q, k, v, seqlens, return_softmax_lse=True, backend=backend)
        if not (torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])):
            raise SystemExit(f"case {number}: a repeat call differs from the first")
    host = default_context(q).host_path
    print(f"case {number}: repeat calls from the compiled host path: {0 if host is None else host.hits}")
torch.cuda.synchronize()
print("sanitize target done")
