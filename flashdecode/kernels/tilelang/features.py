"""The serving features of the TileLang kernels, gated at compile time: paged KV, appended k/v,
seqlen_q > 1, causal and sliding windows, softcap, attention sinks, fp8 caches, left pads and
heads-first caches (``docs/design.md``, "Semantics").

A :class:`Features` is made once per kernel, before its prim_func: it holds the shape's flags, the
symbolic sizes and runtime scalars the features add to the kernel's parameters (None where a feature
is off, which drops the parameter), and expression builders the kernel bodies call. With every
feature off each builder returns the plain kernel's own expression (``x + 0`` folds to ``x``), so
the plain kernels stay byte-identical.

Paged KV: a tile of ``block_n`` tokens lies within one page, or (pages smaller than a tile) gathers
``block_n / page_size`` whole pages, so the tile size and the pipeline do not depend on the page
size. The split kernel's TMA loads then index one page each, per 128-byte column chunk of the
swizzled shared tile (``Features.tile_parts``): tiles of 16 tokens measured 13-117% slower than the
contiguous cache (``docs/design.md``, "Measured choices"). The split kernel with appended tokens keeps tiles
within a page (the backend's default config): TileLang took minutes to compile its gathered tail.
Block ids are clamped into the pages for the reads and a program that meets a bad one writes NaN rows.

Sinks: each query head's logit (float32, natural units) joins a row's softmax denominator once,
where the row is finalised: ``fold_sink`` before an unsplit sequence's output is written, and the
combine's merge starting from it (a partial of lse = sink and output 0); partials never hold it.

fp8 caches (float8_e4m3fn, float8_e5m2): K/V are read as 1-byte elements and converted to q's dtype
before the matrix products (``widen``), which take both operands in one type; k's descale of the
program's (sequence, KV head) multiplies the score scale, v's the output. The descales arrive as a
flat float32 view and its (batch, head) strides (the caller's (batch, nheads_k) view is often
expanded). Appended tokens are stored ``quantise``d, and read so by the attention.

Left pads (``cache_leftpad``): sequence b's keys start at lo_b = max(cache_leftpad[b], its window's
start), clamped to [0, hi_b]; the schedule's blocks start at lo_b's, and the keys of that block
before lo_b are masked (read, in bounds, like those before a window). A left pad outside [0,
cache_seqlens[b]] gives its sequence NaN rows, as a bad length does.

Heads-first caches (transformers' (batch, nheads_k, capacity, headdim), passed as that contiguous
view): a tile of one head's ``block_n`` tokens is then one contiguous block, one TMA box like the
(batch, capacity, nheads_k, headdim) cache's; ``cache_at`` indexes either layout.
"""
import tilelang.language as T

from .config import SCAN_WIDTH
from .macros import LOG2E, NAN

F32, I32 = T.float32, T.int32
#: The largest finite value of each fp8 cache dtype: appended tokens saturate to it.
FP8_LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: Appended tokens written per step (all threads, one head-dim element each).
APPEND_ROWS = 16


class Features:
    """What one kernel's features need while its prim_func is traced (see the module docstring)."""

    def __init__(self, shape, block_n: int):
        self.seqlen_q, self.group, self.page_size = shape.seqlen_q, shape.group, shape.page_size
        self.q_rows = shape.q_rows
        self.block_n = block_n
        self.head_dim, self.cache_element_bytes = shape.headdim, shape.cache_element_bytes
        if shape.page_size and max(block_n, shape.page_size) % min(block_n, shape.page_size):
            raise ValueError(f"block_n must divide the page size {shape.page_size} or be a multiple of it "
                             f"(a tile holds whole pages or part of one), got {block_n}")
        #: Pages one K/V tile gathers (one TMA load each); 1 when a tile lies within a page.
        self.pages_per_tile = max(1, block_n // shape.page_size) if shape.page_size else 1
        self.paged, self.append = shape.paged, shape.append
        self.windowed, self.leftpad, self.heads_first = shape.windowed, shape.leftpad, shape.heads_first
        #: Whether a row may see no key at all in a tile or a split (its max stays -inf): windows, left pads.
        self.keyless_rows = shape.windowed or shape.leftpad
        #: Appended tokens per sequence: k/v's dimension 1 (0 without).
        self.new_tokens = T.dynamic("new_tokens") if shape.append else 0
        self.num_pages, self.max_blocks = T.dynamic("num_pages, max_blocks") if self.paged else (None, None)
        self.softcap = T.Var("softcap", F32) if shape.softcap else None
        self.window_left = T.Var("window_left", I32) if shape.window_left else None
        self.window_right = T.Var("window_right", I32) if shape.window_right else None
        #: sinks: float32 (nheads,), one logit per query head.
        self.sinks = T.Tensor((shape.nheads_k * shape.group,), F32) if shape.sinks else None
        #: The caches' element type: q's, or an fp8 dtype (``fp8``).
        self.dtype, self.cache_dtype, self.fp8 = shape.dtype, shape.cache_dtype or shape.dtype, bool(shape.cache_dtype)
        #: fp8: the elements of k's and v's flat descale views, then their strides (b, h), k's first.
        self.descale_elements = T.dynamic("k_descale_elements, v_descale_elements") if self.fp8 else (None, None)
        self.descale_strides = tuple(T.Var(f"{side}_descale_stride_{axis}", I32) if self.fp8 else None
                                     for side in "kv" for axis in "bh")
        #: Whether the key range of the schedule differs from [0, length) (``key_rule``).
        self.ranged = shape.append or shape.window_left or shape.leftpad
        #: Whether ``attend`` masks more than a tile's invalid keys (windows, left pads) or transforms
        #: scores (softcap).
        self.masks = shape.windowed or shape.softcap or shape.leftpad

    # -- parameter types ---------------------------------------------------------------------------
    def cache(self, B, S, Hk, D):
        """k_cache / v_cache: (B, S, Hk, D), heads-first (B, Hk, S, D), or pages (num_pages, page_size,
        Hk, D), of the caches' dtype."""
        if self.paged:
            return T.Tensor((self.num_pages, self.page_size, Hk, D), self.cache_dtype)
        if self.heads_first:
            return T.Tensor((B, Hk, S, D), self.cache_dtype)
        return T.Tensor((B, S, Hk, D), self.cache_dtype)

    def cache_at(self, cache, b, t, h, d):
        """Element d of key t of sequence b and KV head h in a contiguous cache of either layout."""
        return cache[b, h, t, d] if self.heads_first else cache[b, t, h, d]

    def leftpads(self, B):
        """cache_leftpad: int32 (B,)."""
        return T.Tensor((B,), I32) if self.leftpad else None

    def leftpad_of(self, LeftPad, b):
        """cache_leftpad[b], or None without left pads."""
        return LeftPad[b] if self.leftpad else None

    def read_leftpad(self, LeftPad, b):
        """cache_leftpad[b] read once into a local, or None without left pads."""
        if not self.leftpad:
            return None
        leftpad = T.alloc_var(I32, init=LeftPad[b])
        return leftpad[0]

    def start_of(self, end, leftpad):
        """lo_b (``key_start``) in a local, which every element's mask reads; None without left pads."""
        if leftpad is None:
            return None
        start = T.alloc_var(I32, init=self.key_start(end, leftpad))
        return start[0]

    def capacity(self, S):
        """Keys one sequence can hold: S, or max_blocks * page_size."""
        return self.max_blocks * self.page_size if self.paged else S

    def block_table(self, B):
        return T.Tensor((B, self.max_blocks), I32) if self.paged else None

    def new(self, B, Hk, D, dtype):
        return T.Tensor((B, self.new_tokens, Hk, D), dtype) if self.append else None

    def descale_view(self, side: int):
        """k's (``side`` 0) or v's (1) flat descale view: float32 (elements,)."""
        return T.Tensor((self.descale_elements[side],), F32) if self.fp8 else None

    # -- fp8 caches ----------------------------------------------------------------------------------
    def descale(self, Descale, side: int, b, h):
        """The descale of sequence b and KV head h in k's (``side`` 0) or v's (1) flat view."""
        stride_b, stride_h = self.descale_strides[2 * side:2 * side + 2]
        return Descale[b * stride_b + h * stride_h]

    def descales(self, KDescale, VDescale, b, h):
        """(k's, v's) descale of sequence b and KV head h, each read once into a local (the values of
        those locals); (None, None) without fp8."""
        if not self.fp8:
            return None, None
        k_descale = T.alloc_var(F32, init=self.descale(KDescale, 0, b, h))
        v_descale = T.alloc_var(F32, init=self.descale(VDescale, 1, b, h))
        return k_descale[0], v_descale[0]

    def score_scale(self, scale, descales):
        """The score scale with k's descale folded in (fp8), else ``scale``."""
        return scale if descales[0] is None else scale * descales[0]

    def widen(self, x):
        """A cache element in q's dtype: an fp8 one converted, else x itself."""
        return T.cast(x, self.dtype) if self.fp8 else x

    def quantise(self, x, descale):
        """An appended element x (q's dtype) as the cache stores it: with fp8, x / descale in float32
        (IEEE division), saturated to the dtype's finite range (NaN stays NaN) and rounded to nearest
        even by the conversion (``reference.quantise``); else x itself."""
        if not self.fp8:
            return x
        largest = FP8_LARGEST[self.cache_dtype]
        y = T.ieee_fdiv(T.cast(x, F32), descale)  # an expression, inlined where used
        return T.cast(T.if_then_else(y > largest, largest, T.if_then_else(y < -largest, -largest, y)),
                      self.cache_dtype)

    def lse(self, B, Hq):
        """lse as the kernels index it: (B, Hq) for one query position, else (B, Hq, seqlen_q)."""
        return T.Tensor((B, Hq) if self.seqlen_q == 1 else (B, Hq, self.seqlen_q), F32)

    # -- the key range of sequence b (docs/design.md, "Semantics") ----------------------------------
    def key_end(self, raw_len, capacity, live=True):
        """hi_b: cache_seqlens[b] + seqlen_new clamped to [0, capacity]; 0 unless ``live`` (a program
        without a sequence reads its length as 0)."""
        if not self.append:
            return T.min(T.max(raw_len, 0), capacity)
        return T.min(T.max(raw_len + T.if_then_else(live, self.new_tokens, 0), 0), capacity)

    def bad_length(self, raw_len, end, leftpad=None):
        """Whether the length was outside [0, capacity] or the left pad outside [0, raw_len] (the rows
        are NaN): the clamped ``end`` differs from the sum."""
        return self._flag_bad(raw_len, raw_len + self.new_tokens != end, leftpad)

    def combined_bad_length(self, raw_len, capacity, leftpad=None):
        """``bad_length`` as the combine sees it: a split sequence's length is never negative on its
        own, so the sum past ``capacity`` is what is flagged."""
        return self._flag_bad(raw_len, raw_len + self.new_tokens > capacity, leftpad)

    def _flag_bad(self, raw_len, out_of_range, leftpad):
        """``out_of_range``, or a negative cache_seqlens with appended tokens (which can still sum into
        range), or a left pad outside [0, raw_len]."""
        bad = T.Or(raw_len < 0, out_of_range) if self.append else out_of_range
        return bad if leftpad is None else T.Or(bad, T.Or(leftpad < 0, leftpad > raw_len))

    def pipeline_end(self, blk_lo, full_hi):
        """The pipeline's last block + 1: with appended tokens a split may start past the cached keys,
        so the extent is kept from going negative."""
        return T.max(blk_lo, full_hi) if self.append else full_hi

    def key_start(self, end, leftpad):
        """lo_b of keys ending at ``end`` after a left pad of ``leftpad``: max(leftpad, end - seqlen_q -
        window_left) clamped to [0, end] (``planner.key_range``)."""
        start = T.max(leftpad, 0)
        if self.window_left is not None:
            start = T.max(start, end - self.seqlen_q - self.window_left)
        return T.min(start, end)

    def first_block(self, end, leftpad=None):
        """lo_b // block_n: under a left window the keys before hi_b - seqlen_q - window_left go, and
        those before ``leftpad`` (cache_leftpad[b]; None without)."""
        if leftpad is not None:
            return self.key_start(end, leftpad) // self.block_n
        if self.window_left is None:
            return 0
        return T.max(end - self.seqlen_q - self.window_left, 0) // self.block_n

    def key_rule(self, LeftPad):
        """The schedule's key range rule (``macros.ranged_blocks``) over the kernel's cache_leftpad
        ``LeftPad``, or None for plain keys [0, length)."""
        return _KeyRule(self, LeftPad) if self.ranged else None

    def cached_end(self, raw_len, end):
        """Keys before this come from the cache; the appended ones after it from k/v."""
        return T.min(T.max(raw_len, 0), end) if self.append else end

    def appended_pages(self, raw_len, capacity, writer):
        """(first, end) of the pages the appended tokens go to when ``writer`` holds, else an empty
        range (also without appended tokens)."""
        if not self.append:
            return 0, 0
        end = T.ceildiv(T.min(raw_len + self.new_tokens, capacity), self.page_size)
        return T.max(raw_len, 0) // self.page_size, T.if_then_else(writer, end, 0)

    # -- query rows r = i * group + g (docs/design.md, "GQA packing") --------------------------------
    def query(self, r):
        return r // self.group if self.seqlen_q > 1 else 0

    def head(self, h, r):
        return h * self.group + (r % self.group if self.seqlen_q > 1 else r)

    def sink(self, Sinks, h, r):
        """Query row r's sink logit in base 2 (the kernels' score units); rows past the query rows
        (the q tile's padding) read the last row's."""
        return Sinks[self.head(h, T.min(r, self.q_rows - 1))] * LOG2E

    # -- scores ------------------------------------------------------------------------------------
    def mask(self, base, end, start=None):
        """What ``attend`` needs of the tile starting at key ``base`` of a sequence whose keys end at
        ``end`` (and, with left pads, start at ``start``), or None when it masks only the tile's
        invalid keys."""
        return _TileMask(self, base, end, start) if self.masks else None

    def tile(self, cache, BlockTable, b, kb, h):
        """Tile kb of sequence b's keys of KV head h in the cache, as a region TMA can load: in the
        contiguous cache (either layout), or within the tile's page (``tile_parts`` when a tile
        gathers pages)."""
        if self.paged:  # pages are never heads-first (validate.py), as in cache() and write_appended
            offset = kb * self.block_n % self.page_size
            return cache[page_of(self, BlockTable, b, kb * self.block_n), offset:offset + self.block_n, h, :]
        if self.heads_first:
            return cache[b, h, kb * self.block_n:(kb + 1) * self.block_n, :]
        return cache[b, kb * self.block_n:(kb + 1) * self.block_n, h, :]

    def tile_parts(self, cache, BlockTable, b, kb, h, tile):
        """(source, destination) regions of the TMA loads that gather tile kb from pages smaller than
        a tile into shared ``tile``: per page, per 128-byte column chunk, as the swizzled shared
        layout stores a tile (chunk-major, so a page's rows of one chunk are contiguous there).
        A Python list: the loads are unrolled as the kernel is traced."""
        rows, width = self.page_size, min(self.head_dim, 128 // self.cache_element_bytes)
        return [(cache[page_of(self, BlockTable, b, kb * self.block_n + p * rows), 0:rows, h, c:c + width],
                 tile[p * rows:(p + 1) * rows, c:c + width])
                for p in range(self.pages_per_tile) for c in range(0, self.head_dim, width)]

    def source(self, KNew, VNew, BlockTable, cached, descales=(None, None)):
        """Where ``load_tile`` reads keys (pages, appended tokens), or None for a contiguous cache.
        ``descales``: (k's, v's) of the program's sequence and KV head, for appended tokens in an fp8
        cache."""
        if not (self.paged or self.append):
            return None
        return _TileSource(self, KNew, VNew, BlockTable, cached, descales)


    # -- the combine ---------------------------------------------------------------------------------
    def combine_shift(self, m):
        """The max the combine's exponents subtract: with windows or left pads 0 while every partial
        so far saw no key (m = -inf)."""
        return T.if_then_else(m == -T.infinity(F32), 0, m) if self.keyless_rows else m

    def combined(self, acc, w_sum, m):
        """The merged output: acc / w_sum; with windows or left pads 0 for a row that saw no key."""
        return T.if_then_else(m == -T.infinity(F32), 0, acc / w_sum) if self.keyless_rows else acc / w_sum


class _KeyRule:
    """Sequence b's key range [lo_b, hi_b) as the schedule counts its blocks (appended tokens, a left
    window, left pads read from ``LeftPad``)."""

    def __init__(self, features, LeftPad):
        self.features, self.LeftPad = features, LeftPad

    def key_end(self, raw_len, capacity):
        return self.features.key_end(raw_len, capacity)

    def first_block(self, end, b):
        return self.features.first_block(end, self.features.leftpad_of(self.LeftPad, b))


class _TileMask:
    """Per-row visibility and score transform of one tile (windows, left pads and softcap)."""

    def __init__(self, features, base, end, start):
        self.features, self.base, self.end, self.start = features, base, end, start

    def visible(self, i, j, n_valid):
        """Key ``base + j`` for q-tile row i: valid, at or after the left pad's ``start``, and inside
        the row's window, whose position is p_i = end - seqlen_q + query(i) (bottom-right alignment)."""
        f = self.features
        seen = j < n_valid
        if self.start is not None:
            seen = T.And(seen, self.base + j >= self.start)
        position = self.end - f.seqlen_q + i // f.group
        if f.window_left is not None:
            seen = T.And(seen, self.base + j >= position - f.window_left)
        if f.window_right is not None:
            seen = T.And(seen, self.base + j <= position + f.window_right)
        return seen

    def score(self, s, scale):
        """The base-2 score of a raw product s: s * scale, or with softcap
        softcap * tanh(s * softmax_scale / softcap) in base 2 (``scale`` = softmax_scale * log2 e)."""
        if self.features.softcap is None:
            return s * scale
        cap = self.features.softcap * 1.4426950408889634
        return T.tanh(s * (scale / cap)) * cap

    def shift(self, m):
        """The max the exponents subtract: 0 for a row that has seen no key yet (m = -inf), so that its
        scores give exp2(-inf) = 0, not NaN."""
        if not self.features.keyless_rows:
            return m
        return T.if_then_else(m == -T.infinity(F32), 0, m)


class _TileSource:
    """Where the keys of a tile live: its page (a tile never crosses one) and, for appended tokens,
    k/v from ``cached`` on (quantised as an fp8 cache stores them). Elements come in q's dtype."""

    def __init__(self, features, KNew, VNew, BlockTable, cached, descales):
        self.features, self.KNew, self.VNew, self.BlockTable, self.cached = features, KNew, VNew, BlockTable, cached
        self.descales = descales

    def parts(self, block_n):
        """(first row, rows) of the parts of a tile that each lie within one page: a Python list (the
        loads unroll as the kernel is traced), so each part reads its page's id once, outside its
        loop over rows (an id read per row made TileLang's vectorizer search for minutes)."""
        rows = block_n // self.features.pages_per_tile
        return [(part * rows, rows) for part in range(self.features.pages_per_tile)]

    def page(self, b, base):
        """The page of the part starting at key ``base`` (0 for a contiguous cache)."""
        return page_of(self.features, self.BlockTable, b, base) if self.features.paged else 0

    def key(self, K, b, page, base, j, h, d):
        return self._read(K, self.KNew, self.descales[0], b, page, base, j, h, d)

    def value(self, V, b, page, base, j, h, d):
        return self._read(V, self.VNew, self.descales[1], b, page, base, j, h, d)

    def _read(self, cache, new, descale, b, page, base, j, h, d):
        f = self.features
        if f.paged:
            stored = f.widen(cache[page, base % f.page_size + j, h, d])
        else:
            stored = f.widen(f.cache_at(cache, b, base + j, h, d))
        if not f.append:
            return stored
        return T.if_then_else(base + j >= self.cached,
                              f.widen(f.quantise(new[b, base + j - self.cached, h, d], descale)), stored)


def page_of(features, BlockTable, b, position):
    """The page holding key ``position`` of sequence b, its id clamped into the pages."""
    return T.min(T.max(BlockTable[b, position // features.page_size], 0), features.num_pages - 1)


@T.macro
def bad_pages(BlockTable, b, first_page, end_page, num_pages, flags):
    """1 if a block id of sequence b in [first_page, end_page) is outside [0, num_pages), else 0;
    all threads read SCAN_WIDTH ids at once into ``flags`` (shared). The reads are clamped into the
    table rather than guarded: a guard over a loaded value makes TileLang's vectorizer search for
    minutes."""
    bad = T.alloc_var(I32, init=0)
    for c in T.serial(T.ceildiv(end_page - first_page, SCAN_WIDTH)):
        for t in T.Parallel(SCAN_WIDTH):
            flags[t] = T.cast(T.And(first_page + c * SCAN_WIDTH + t < end_page, T.Or(
                BlockTable[b, T.min(first_page + c * SCAN_WIDTH + t, BlockTable.shape[1] - 1)] < 0,
                BlockTable[b, T.min(first_page + c * SCAN_WIDTH + t, BlockTable.shape[1] - 1)] >= num_pages)), I32)
        for t in T.serial(T.min(SCAN_WIDTH, end_page - first_page - c * SCAN_WIDTH)):
            bad = T.max(bad, flags[t])
    return bad


@T.macro
def write_appended(features, K, V, KNew, VNew, BlockTable, b, h, raw_len, capacity, head_dim, descales):
    """Writes sequence b's appended tokens of KV head h into the cache at cache_seqlens[b] + j
    (fp8: ``quantise``d by ``descales``, k's and v's), skipping positions outside [0, capacity) and
    pages whose id is bad (a write never lands on a clamped page). One program per (sequence, KV
    head) writes; every read of those keys in the same call takes them from k/v, so nothing races."""
    for c in T.serial(T.ceildiv(features.new_tokens, APPEND_ROWS)):
        for j, d in T.Parallel(APPEND_ROWS, head_dim):
            token = c * APPEND_ROWS + j
            position = raw_len + token
            if T.And(token < features.new_tokens, T.And(position >= 0, position < capacity)):
                if features.paged:
                    page = BlockTable[b, position // features.page_size]
                    if T.And(page >= 0, page < features.num_pages):
                        K[page, position % features.page_size, h, d] = features.quantise(KNew[b, token, h, d],
                                                                                         descales[0])
                        V[page, position % features.page_size, h, d] = features.quantise(VNew[b, token, h, d],
                                                                                         descales[1])
                elif features.heads_first:
                    K[b, h, position, d] = features.quantise(KNew[b, token, h, d], descales[0])
                    V[b, h, position, d] = features.quantise(VNew[b, token, h, d], descales[1])
                else:
                    K[b, position, h, d] = features.quantise(KNew[b, token, h, d], descales[0])
                    V[b, position, h, d] = features.quantise(VNew[b, token, h, d], descales[1])


@T.macro
def fold_sink(features, Sinks, h, o_f, l_f, m_f, alpha, rows, head_dim):
    """The online-softmax state (o_f, l_f, m_f) of KV head h's query rows with each row's sink in its
    denominator: a key of the sink's score and value 0. A row whose max and sink are both -inf keeps
    l = 0 (no key: out 0, lse -inf)."""
    for i in T.Parallel(rows):
        sink = features.sink(Sinks, h, i)  # read once per row
        shift = T.if_then_else(T.max(m_f[i], sink) == -T.infinity(F32), 0, T.max(m_f[i], sink))
        alpha[i] = T.exp2(m_f[i] - shift)
        l_f[i] = l_f[i] * alpha[i] + T.exp2(sink - shift)
        m_f[i] = T.max(m_f[i], sink)
    for i, d in T.Parallel(rows, head_dim):
        o_f[i, d] *= alpha[i]


@T.macro
def descale_output(o_f, v_descale, rows, head_dim):
    """The output accumulator times v's descale (an fp8 cache's values were read as stored)."""
    for i, d in T.Parallel(rows, head_dim):
        o_f[i, d] *= v_descale


def partial_value(features, o, l, bad):
    """A split's partial output row: o / l; with windows or left pads 0 for a row that saw no key
    (l = 0), and NaN where the program met a bad block id (``bad``; None without pages)."""
    value = T.if_then_else(l == 0, 0, o / l) if features.keyless_rows else o / l
    return value if bad is None else T.if_then_else(bad > 0, NAN, value)


def partial_lse(features, l, m, bad):
    """A split's partial log2-sum-exp: -inf for a row that saw no key, NaN after a bad block id."""
    value = T.if_then_else(l == 0, -T.infinity(F32), T.log2(l) + m) if features.keyless_rows else T.log2(l) + m
    return value if bad is None else T.if_then_else(bad > 0, NAN, value)
