"""The benchmark's case matrices, their variants and the input generator, defined once for tests,
bench and profile.

Three matrices. ``cases`` (the default): the 14 cases 1-14, 32 query heads, head dim 128, bfloat16;
``../shared/anchors/h200-peers.json`` (copied into ``flashdecode/data``) was measured on exactly
these inputs. ``wide``: W1-W14, shapes the 14 leave out: MHA, MQA, groups up to 32, head dims 64
and 256, batch 1-256, caches of 32 to 256k tokens, equal, uniform and skewed lengths. ``models``:
M1-M16, the heads one GPU holds for public models' attention configs (MHA, groups of 2-71 including
3, 5, 6, 7 and 12, head dims 64, 80, 96, 128 and 256) at batches and lengths a server meets.

A variant changes how a case is called (``docs/design.md``, "Semantics"): ``plain`` decode, the
cache in shuffled pages of 16/64/256 tokens, 4 causal query tokens, one appended k/v token, the
cache in fp8 (e4m3) with per-head descales, a sink logit per head, or ragged drafts (speculative
decoding's verify step: 1-8 causal query tokens per sequence, appended as they are scored, q packed
by ``cu_seqlens_q``), with its two comparisons: the padded call of about as many query rows, and one
call per draft length.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from .problem import Problem, offsets_fit_32
from .reference import quantise

NHEADS = 32
HEADDIM = 128
DTYPE = torch.bfloat16
#: How a case's cache_seqlens are drawn (:func:`case_seqlens`).
LENGTH_RULES = ("matrix", "equal", "uniform", "skewed")
#: The skewed rule's short sequences hold at most seqlen_cache // SKEW_RATIO tokens.
SKEW_RATIO = 64


@dataclasses.dataclass(frozen=True)
class Case:
    number: int
    batch: int
    seqlen_cache: int
    nheads_k: int
    group: int
    headdim: int = HEADDIM
    lengths: str = "matrix"  # one of LENGTH_RULES
    matrix: str = "cases"  # a key of MATRIX_PREFIX

    @property
    def nheads(self) -> int:
        return self.nheads_k * self.group

    @property
    def label(self) -> str:
        """The case's name on the command line and in reports: "7", "W3" or "M5"."""
        return f"{MATRIX_PREFIX[self.matrix]}{self.number}"

    def describe(self) -> str:
        extra = ("" if self.headdim == HEADDIM else f" d{self.headdim}") + \
                ("" if self.lengths == "matrix" else f" {self.lengths}")
        return f"b{self.batch} s{self.seqlen_cache} hk{self.nheads_k} g{self.group}{extra}"

    @property
    def spelling(self) -> str:
        """The case as ``bench --shapes`` and ``profile --shape`` take it: ``16x2048x1x71x64:uniform``
        (a matrix case has no length rule of its own: ``parse_shapes`` refuses "matrix")."""
        return f"{self.batch}x{self.seqlen_cache}x{self.nheads_k}x{self.group}x{self.headdim}:{self.lengths}"

    def seqlens(self) -> torch.Tensor:
        return case_seqlens(self.batch, self.seqlen_cache, self.lengths)


CASES: tuple[Case, ...] = tuple(
    Case(number, *shape)
    for number, shape in enumerate(
        [
            (1, 1, 4, 8), (4, 2, 8, 4), (16, 17, 4, 8), (64, 64, 8, 4), (16, 141, 4, 8),
            (16, 362, 8, 4), (64, 2048, 8, 4), (16, 4096, 4, 8), (32, 4096, 8, 4), (1, 8192, 4, 8),
            (16, 12251, 4, 8), (8, 32768, 8, 4), (1, 58966, 8, 4), (1, 61519, 4, 8),
        ],
        start=1,
    )
)
CASES_BY_NUMBER = {case.number: case for case in CASES}

#: (batch, seqlen_cache, nheads_k, group, headdim, lengths): the wide matrix, bfloat16.
WIDE_CASES: tuple[Case, ...] = tuple(
    Case(number, *shape, matrix="wide")
    for number, shape in enumerate(
        [
            (8, 4096, 32, 1, 128, "equal"),  # MHA
            (1, 32768, 32, 1, 128, "equal"),  # MHA, one long sequence
            (64, 8192, 1, 32, 128, "uniform"),  # MQA, group 32
            (256, 512, 1, 16, 128, "uniform"),  # MQA, batch 256
            (32, 16384, 2, 16, 128, "uniform"),  # 2 KV heads, group 16
            (1, 262144, 1, 32, 128, "equal"),  # 256k tokens
            (4, 131072, 2, 16, 128, "skewed"),  # one long sequence among short ones
            (16, 8192, 8, 4, 64, "uniform"),  # head dim 64
            (16, 8192, 8, 4, 256, "uniform"),  # head dim 256
            (8, 32768, 1, 8, 256, "equal"),  # head dim 256, MQA
            (16, 32768, 4, 8, 128, "skewed"),
            (256, 2048, 4, 8, 128, "uniform"),  # batch 256
            (128, 32, 8, 4, 128, "equal"),  # 32-token caches
            (64, 1024, 32, 1, 64, "uniform"),  # MHA, head dim 64
        ],
        start=1,
    )
)
#: (batch, seqlen_cache, nheads_k, group, headdim, lengths): the heads of one GPU (tensor parallel
#: degree in brackets) of public models' configs (num_attention_heads, num_key_value_heads,
#: head_dim), bfloat16.
MODEL_CASES: tuple[Case, ...] = tuple(
    Case(number, *shape, matrix="models")
    for number, shape in enumerate(
        [
            (64, 4096, 8, 4, 128, "uniform"),  # Llama-3.1-8B (TP1): 32 / 8 heads
            (32, 8192, 1, 8, 128, "uniform"),  # Llama-3.1-70B (TP8): 64 / 8
            (1, 131072, 2, 8, 128, "equal"),  # Llama-3.1-70B (TP4), one long request
            (32, 4096, 8, 3, 128, "uniform"),  # Llama-3.2-3B: 24 / 8, group 3
            (16, 16384, 4, 7, 128, "uniform"),  # Qwen2.5-7B: 28 / 4, group 7
            (64, 2048, 8, 5, 128, "uniform"),  # Qwen2.5-14B: 40 / 8, group 5
            (128, 1024, 2, 6, 128, "uniform"),  # Qwen2.5-1.5B: 12 / 2, group 6
            (256, 512, 2, 7, 64, "uniform"),  # Qwen2.5-0.5B: 14 / 2, head dim 64
            (16, 8192, 8, 2, 256, "uniform"),  # Gemma-2-9B: 16 / 8, head dim 256
            (32, 4096, 16, 2, 128, "uniform"),  # Gemma-2-27B: 32 / 16
            (16, 4096, 32, 1, 96, "uniform"),  # Phi-3-mini: MHA, head dim 96
            (8, 2048, 32, 1, 80, "equal"),  # Phi-2: MHA, head dim 80
            (8, 16384, 4, 12, 128, "skewed"),  # StarCoder2-15B: 48 / 4, group 12
            (16, 2048, 1, 71, 64, "uniform"),  # Falcon-7B: 71 / 1 (MQA)
            (64, 8192, 1, 8, 64, "uniform"),  # gpt-oss-120b (TP8): 64 / 8, head dim 64
            (1, 1024, 8, 4, 128, "equal"),  # Llama-3.1-8B, one short request (latency)
        ],
        start=1,
    )
)
MATRICES = {"cases": CASES, "wide": WIDE_CASES, "models": MODEL_CASES}
#: Label prefixes; "shapes" holds the cases a command line gives (``parse_shapes``), S1, S2, ...
MATRIX_PREFIX = {"cases": "", "wide": "W", "models": "M", "shapes": "S"}
#: Every case of the matrices by its label ("7", "W3", "M5"), as commands and logs name them.
CASES_BY_LABEL = {case.label: case for matrix in MATRICES.values() for case in matrix}


def parse_shapes(text: str) -> tuple[Case, ...]:
    """Cases S1, S2, ... of a comma list of ``batch x seqlen_cache x nheads_k x group x headdim:rule``
    (``rule`` one of LENGTH_RULES but "matrix"), e.g. ``16x2048x1x71x64:uniform``; ValueError naming
    the bad item otherwise."""
    shapes = []
    for number, item in enumerate(filter(None, (part.strip() for part in text.split(","))), start=1):
        sizes, _, rule = item.partition(":")
        fields = sizes.split("x")
        if rule not in LENGTH_RULES[1:] or len(fields) != 5 or not all(field.isdigit() and int(field) > 0
                                                                       for field in fields):
            raise ValueError(f"each shape is batch x seqlen_cache x nheads_k x group x headdim (positive), ':' and "
                             f"a length rule of {', '.join(LENGTH_RULES[1:])}, e.g. 64x4096x8x4x256:uniform; "
                             f"got {item!r}")
        shapes.append(Case(number, *map(int, fields), lengths=rule, matrix="shapes"))
    return tuple(shapes)


def select(matrix: str, text: str = "all") -> tuple[Case, ...]:
    """The cases of ``matrix`` that ``text`` names: "all", or labels and ranges such as "1,3,7-9"
    (matrix "cases"), "W1,W3-W5" (matrix "wide") or "M2,M5-M7" (matrix "models"), in the order given,
    duplicates dropped.
    ValueError naming the offending part otherwise."""
    if matrix not in MATRICES:
        raise ValueError(f"unknown matrix {matrix!r}; matrices are {', '.join(MATRICES)}")
    members = {case.label: case for case in MATRICES[matrix]}
    if text.strip().lower() == "all":
        return MATRICES[matrix]
    prefix = MATRIX_PREFIX[matrix]
    example = "1,3,7-9" if not prefix else f"{prefix}1,{prefix}3-{prefix}5"
    chosen = {}
    for part in text.split(","):
        ends = [end.strip() for end in part.split("-")]
        numbers = []
        for end in ends:
            if not (end.startswith(prefix) and end[len(prefix):].isdigit()):
                raise ValueError(f"invalid case list {text!r}: matrix {matrix!r} takes labels and ranges "
                                 f"like {example}")
            numbers.append(int(end[len(prefix):]))
        if len(numbers) > 2 or numbers[0] > numbers[-1]:
            raise ValueError(f"invalid case range {part.strip()!r} in {text!r}")
        for number in range(numbers[0], numbers[-1] + 1):
            label = f"{prefix}{number}"
            if label not in members:
                first, last = MATRICES[matrix][0].label, MATRICES[matrix][-1].label
                raise ValueError(f"unknown case {label} in {text!r}: matrix {matrix!r} has cases {first}-{last}")
            chosen.setdefault(label, members[label])
    return tuple(chosen.values())


def case_seqlens(batch: int, seqlen_cache: int, rule: str = "matrix") -> torch.Tensor:
    """int32 lengths, seeded; row 0 is always at full length (batch 1: [seqlen_cache]).
    "matrix": randint in [ceil(S/4), S] (the anchor files' rule); "equal": all S; "uniform":
    randint in [1, S]; "skewed": the others randint in [1, max(1, S // SKEW_RATIO)]."""
    if rule not in LENGTH_RULES:
        raise ValueError(f"rule must be one of {LENGTH_RULES}, got {rule!r}")
    if batch == 1 or rule == "equal":
        return torch.full((batch,), seqlen_cache, dtype=torch.int32)
    low, high = {"matrix": (max(1, math.ceil(seqlen_cache / 4)), seqlen_cache), "uniform": (1, seqlen_cache),
                 "skewed": (1, max(1, seqlen_cache // SKEW_RATIO))}[rule]
    generator = torch.Generator("cpu").manual_seed(0)
    lengths = torch.randint(low=low, high=high + 1, size=(batch,), generator=generator)
    lengths[0] = seqlen_cache
    return lengths.to(torch.int32)


def _randn(generator, device, dtype, *shape):
    return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)


def make_inputs(case: Case, device="cpu", dtype=DTYPE, headdim=None, seed=1):
    """Fresh random q, k_cache, v_cache (randn, never zeros) and the case's cache_seqlens;
    ``headdim`` None: the case's."""
    headdim = case.headdim if headdim is None else headdim
    generator = torch.Generator(device).manual_seed(seed)
    q = _randn(generator, device, dtype, case.batch, 1, case.nheads, headdim)
    k_cache = _randn(generator, device, dtype, case.batch, case.seqlen_cache, case.nheads_k, headdim)
    v_cache = _randn(generator, device, dtype, case.batch, case.seqlen_cache, case.nheads_k, headdim)
    return q, k_cache, v_cache, case.seqlens().to(device)


def bytes_read(case_or_lengths, nheads_k: int, nheads: int, headdim: int = HEADDIM, element_bytes: int = 2,
               seqlen_q=1, seqlen_new=0, cache_element_bytes: int | None = None) -> int:
    """Bytes a call must move: K and V of every key a sequence sees (``lengths``: cache_seqlens +
    seqlen_new; cached keys read from the cache, new ones from k/v), the new rows written into the
    cache, q read and out written. ``seqlen_q``, ``seqlen_new``: ints, or per sequence (ragged). K/V
    elements take ``cache_element_bytes`` (1 for an fp8 cache; default ``element_bytes``, q's)."""
    total_tokens = int(sum(case_or_lengths))
    batch = len(case_or_lengths)
    rows = sum(seqlen_q) if isinstance(seqlen_q, list) else batch * seqlen_q
    appended = sum(seqlen_new) if isinstance(seqlen_new, list) else batch * seqlen_new
    row = nheads_k * headdim * (element_bytes if cache_element_bytes is None else cache_element_bytes)
    return total_tokens * row * 2 + appended * row * 2 + 2 * rows * nheads * headdim * element_bytes


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a case is called: pages, query tokens, appended tokens."""

    name: str
    description: str
    page_size: int = 0  # 0: the contiguous cache
    seqlen_q: int = 1  # > 1: causal
    seqlen_new: int = 0  # k/v tokens appended
    pages_in_order: bool = False  # the block table in page order (a diagnostic: the shuffle's cost)
    cache_dtype: str | None = None  # an fp8 dtype's name: the cache quantised to it (``fp8_descales``)
    sinks: bool = False  # a float32 sink logit per query head
    #: > 0: draft lengths 1 to this drawn per sequence (sorted, so that each length's sequences are
    #: adjacent; then at most the sequence's keys), each appended and scored causally; ``ragged`` says
    #: how it is called
    max_draft: int = 0
    #: "packed": cu_seqlens_q; "padded": ceil(drafts / batch) rows each; "per_length": a call per length
    ragged: str = ""

    @property
    def causal(self) -> bool:
        return self.seqlen_q > 1 or self.max_draft > 0

    def token_counts(self, case: Case) -> tuple:
        """(query rows, appended tokens) of :func:`make_call`'s call: ints, or per sequence (ragged)."""
        if not self.max_draft:
            return self.seqlen_q, self.seqlen_new
        drafts = draft_lengths(case, self)
        if self.ragged == "padded":
            width = -(-sum(drafts) // case.batch)
            return width, width
        return drafts, drafts

    def problem(self, case: Case, dtype: str = "bfloat16") -> Problem:
        """The Problem ``validate`` makes of :func:`make_call` (``case``, this variant): a paged
        capacity is whole pages; ragged ("per_length" too: its call's arguments are the packed call's)
        with seqlen_q = seqlen_new = max_draft."""
        capacity = case.seqlen_cache
        if self.page_size:
            capacity = -(-capacity // self.page_size) * self.page_size
        seqlen_q, seqlen_new = self.token_counts(case)
        ragged = isinstance(seqlen_q, list)
        if ragged:
            seqlen_q = seqlen_new = self.max_draft
        return Problem(case.batch, capacity, case.nheads, case.nheads_k, case.headdim, dtype, seqlen_q=seqlen_q,
                       page_size=self.page_size, seqlen_new=seqlen_new,
                       window_right=0 if self.causal and seqlen_q > 1 else -1,
                       offsets_32=offsets_fit_32((case.batch, capacity, case.nheads_k, case.headdim)),
                       cache_dtype=self.cache_dtype, sinks=self.sinks, ragged=ragged)


VARIANTS = {variant.name: variant for variant in (
    Variant("plain", "decode over the contiguous cache"),
    *(Variant(f"paged{size}", f"the cache copied into pages of {size} tokens, block table in shuffled page order",
              page_size=size) for size in (1, 4, 16, 64, 256)),
    *(Variant(f"paged{size}-ordered", f"the cache copied into pages of {size} tokens, block table in page order "
                                      f"(what paged{size} costs beyond the shuffle)", page_size=size,
              pages_in_order=True) for size in (16, 64)),
    Variant("q4", "seqlen_q = 4, causal=True", seqlen_q=4),
    Variant("append", "k/v of 1 new token appended: cache_seqlens = lengths - 1 (idempotent: same token, "
                      "same slot)", seqlen_new=1),
    Variant("fp8", "the cache in float8_e4m3fn, k_descale/v_descale of shape (nheads_k,): the cache's amax / 448 "
                   "in every head (one calibrated scale per tensor, as vLLM's, which FlashInfer's float k_scale "
                   "and v_scale also take)", cache_dtype="float8_e4m3fn"),
    Variant("sinks", "decode with a float32 sink logit per query head (gpt-oss)", sinks=True),
    Variant("ragged", "draft lengths 1-8 per sequence, packed by cu_seqlens_q, appended and scored causally",
            max_draft=8, ragged="packed"),
    Variant("ragged-padded", "ragged's drafts as a padded call of ceil(total drafts / batch) causal rows per "
                             "sequence (about as many query rows)", max_draft=8, ragged="padded"),
    Variant("ragged-per-length", "ragged's call as one padded call per draft length (its sequences, adjacent)",
            max_draft=8, ragged="per_length"),
)}


@dataclasses.dataclass
class Call:
    """The arguments of one ``flash_attn_with_kvcache`` call of a case under a variant."""

    q: torch.Tensor
    k_cache: torch.Tensor  # (batch, capacity, Hk, D), or pages (num_pages, page_size, Hk, D)
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    lengths: list[int]  # keys each sequence sees: cache_seqlens + seqlen_new
    block_table: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    causal: bool = False
    k_descale: torch.Tensor | None = None  # float32 (nheads_k,) of an fp8 cache
    v_descale: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None  # ragged: q, k, v packed (total_q, heads, headdim)
    max_seqlen_q: int | None = None
    #: "ragged-per-length": the calls that compute this one (each writes its rows of ``out``)
    parts: list | None = None
    out: torch.Tensor | None = None

    def kwargs(self) -> dict:
        """Every argument after q, k_cache, v_cache, by keyword (descales, sinks and the ragged ones
        only where given)."""
        extra = {name: value for name, value in (("k_descale", self.k_descale), ("v_descale", self.v_descale),
                                                 ("sinks", self.sinks), ("cu_seqlens_q", self.cu_seqlens_q),
                                                 ("max_seqlen_q", self.max_seqlen_q)) if value is not None}
        return {"k": self.k, "v": self.v, "cache_seqlens": self.cache_seqlens, "block_table": self.block_table,
                "causal": self.causal, **extra}

    def bytes_moved(self) -> int:
        """:func:`bytes_read` of this call (K/V at the cache's element size; ragged: each sequence's
        query rows, as many appended)."""
        nheads, headdim = self.q.shape[-2:]
        cache_bytes = self.k_cache.element_size()
        if self.cu_seqlens_q is not None:
            drafts = self.cu_seqlens_q.diff().tolist()
            return bytes_read(self.lengths, self.k_cache.shape[2], nheads, headdim, self.q.element_size(), drafts,
                              drafts, cache_bytes)
        return bytes_read(self.lengths, self.k_cache.shape[2], nheads, headdim, self.q.element_size(),
                          self.q.shape[1], 0 if self.k is None else self.k.shape[1], cache_bytes)

    def storage_bytes(self) -> int:
        """Device memory its tensors hold."""
        tensors = (self.q, self.k_cache, self.v_cache, self.cache_seqlens, self.block_table, self.k, self.v, self.out)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _pages(cache, tail, page_size: int, order: torch.Tensor):
    """``cache`` (B, S, Hk, D) with ``tail`` appended up to whole pages, page i of it stored at page order[i]."""
    pages = torch.cat([cache, tail], dim=1).view(-1, page_size, *cache.shape[2:])
    stored = torch.empty_like(pages)
    stored[order] = pages
    return stored


def make_call(case: Case, variant: Variant, device="cpu", dtype=DTYPE, seed=1) -> Call:
    """The case's inputs (:func:`make_inputs` with ``seed``) called as ``variant`` says; what the
    variant adds is drawn from a second generator, so every variant shares the plain cache."""
    q, k_cache, v_cache, seqlens = make_inputs(case, device, dtype, seed=seed)
    generator = torch.Generator(device).manual_seed(seed + 10_000)
    lengths = seqlens.tolist()
    call = Call(q, k_cache, v_cache, seqlens, lengths)
    if variant.seqlen_q > 1:
        call.q = _randn(generator, device, dtype, case.batch, variant.seqlen_q, case.nheads, case.headdim)
        call.causal = True
    if variant.seqlen_new:
        call.k = _randn(generator, device, dtype, case.batch, variant.seqlen_new, case.nheads_k, case.headdim)
        call.v = _randn(generator, device, dtype, case.batch, variant.seqlen_new, case.nheads_k, case.headdim)
        call.cache_seqlens = (seqlens - variant.seqlen_new).clamp(min=0)
    if variant.page_size:
        blocks = -(-case.seqlen_cache // variant.page_size)
        order = torch.arange(case.batch * blocks) if variant.pages_in_order else \
            torch.randperm(case.batch * blocks, generator=torch.Generator("cpu").manual_seed(0))
        order = order.to(device)
        tail = (case.batch, blocks * variant.page_size - case.seqlen_cache, case.nheads_k, case.headdim)
        call.k_cache = _pages(k_cache, _randn(generator, device, dtype, *tail), variant.page_size, order)
        call.v_cache = _pages(v_cache, _randn(generator, device, dtype, *tail), variant.page_size, order)
        call.block_table = order.view(case.batch, blocks).to(torch.int32)
    if variant.cache_dtype:
        fp8 = getattr(torch, variant.cache_dtype)
        call.k_descale, call.v_descale = (fp8_descales(cache, fp8) for cache in (call.k_cache, call.v_cache))
        call.k_cache = quantise(call.k_cache, call.k_descale, fp8)
        call.v_cache = quantise(call.v_cache, call.v_descale, fp8)
    if variant.sinks:
        call.sinks = torch.randn(case.nheads, generator=generator, device=device, dtype=torch.float32)
    if variant.max_draft:
        _drafts(call, case, variant, generator, device, dtype, seed)
    return call


def fp8_descales(cache: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """float32 (nheads_k,) descales of ``cache`` in ``fp8``: its largest magnitude over the fp8 range,
    the same in every head (a per-tensor calibration, given per head)."""
    scale = cache.abs().amax().float() / torch.finfo(fp8).max
    return scale.expand(cache.shape[2]).contiguous()


def draft_lengths(case: Case, variant: Variant, seed: int = 1) -> list[int]:
    """A ragged variant's drafts for :func:`make_call` with ``seed``: 1 to ``max_draft`` tokens per
    sequence drawn on the CPU (the same on every device), sorted, then at most the sequence's keys."""
    drawn = torch.randint(1, variant.max_draft + 1, (case.batch,), generator=torch.Generator().manual_seed(seed))
    return [min(draft, max(length, 1)) for draft, length in zip(sorted(drawn.tolist()), case.seqlens().tolist())]


def _drafts(call: Call, case: Case, variant: Variant, generator, device, dtype, seed: int) -> None:
    """``call`` as a verify step of drafts of 1 to ``max_draft`` tokens per sequence (sorted, then at
    most the sequence's keys), each appended at cache_seqlens = lengths - draft and scored causally,
    called as ``variant.ragged`` says ("per_length": a call per run of one length); every way holds
    the same tokens, so their outputs pack alike."""
    drafts = draft_lengths(case, variant, seed)
    rows = sum(drafts)
    q = _randn(generator, device, dtype, rows, case.nheads, case.headdim)
    k, v = (_randn(generator, device, dtype, rows, case.nheads_k, case.headdim) for _ in range(2))
    call.cache_seqlens = (call.cache_seqlens - torch.tensor(drafts, device=device, dtype=torch.int32)).clamp(min=0)
    call.lengths = (call.cache_seqlens + torch.tensor(drafts, device=device, dtype=torch.int32)).tolist()
    call.causal = True
    call.q, call.k, call.v = q, k, v
    call.cu_seqlens_q = torch.tensor([0, *itertools.accumulate(drafts)], dtype=torch.int32, device=device)
    call.max_seqlen_q = variant.max_draft
    if variant.ragged == "padded":  # about as many rows: ceil(rows / batch) each
        width = -(-rows // case.batch)
        call.q = _randn(generator, device, dtype, case.batch, width, case.nheads, case.headdim)
        call.k, call.v = (_randn(generator, device, dtype, case.batch, width, case.nheads_k, case.headdim)
                          for _ in range(2))
        call.cache_seqlens = (torch.tensor(call.lengths, device=device, dtype=torch.int32) - width).clamp(min=0)
        call.lengths = (call.cache_seqlens + width).clamp(max=case.seqlen_cache).tolist()
        call.cu_seqlens_q = call.max_seqlen_q = None
    elif variant.ragged == "per_length":
        call.out = torch.empty_like(q)
        call.parts = []
        first = sequence = 0
        for draft, run in itertools.groupby(drafts):
            count = len(list(run))
            batch, packed = slice(sequence, sequence + count), slice(first, first + count * draft)
            call.parts.append(Call(q[packed].view(count, draft, case.nheads, case.headdim), call.k_cache[batch],
                                   call.v_cache[batch], call.cache_seqlens[batch], call.lengths[batch],
                                   k=k[packed].view(count, draft, case.nheads_k, case.headdim),
                                   v=v[packed].view(count, draft, case.nheads_k, case.headdim), causal=True,
                                   out=call.out[packed].view(count, draft, case.nheads, case.headdim)))
            first, sequence = packed.stop, batch.stop
