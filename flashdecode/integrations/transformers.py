"""flashdecode as a Hugging Face transformers attention backend (``pip install flashdecode[transformers]``).

``register()`` adds an attention function and its mask function to transformers' interfaces and
returns the name to pass as ``attn_implementation=``::

    from flashdecode.integrations import transformers as fd_transformers
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=fd_transformers.register())

Decode steps (at most ``MAX_DECODE_QUERY`` new tokens a sequence) run ``flash_attn_with_kvcache``
straight over transformers' cache tensors: a layer's keys (batch, kv_heads, kv_len, head_dim) are
seen as (batch, kv_len, kv_heads, head_dim) by a transpose, no copy. The mask function turns
transformers' mask into each sequence's visible key range, once per forward and layer type: its
first key is ``cache_leftpad`` (left padding), its end ``cache_seqlens`` (StaticCache's buffers
hold ``max_cache_len`` slots; the valid ones end there). Sliding windows, softcap and the model's
scaling go to the call as they are, and gpt-oss's attention sinks (``s_aux``) as ``sinks``.
Longer queries (prefill) go to SDPA, or, for softcap and sink models (which SDPA cannot run), to
flashdecode too.

The name has no "flash" in it: transformers 5.x sends every name containing "flash" to its
flash-kernel loader, which would look for a hub kernel. The paged path of ``generate_batch`` does
go through that loader: see :func:`paged_kernel`.

Written against transformers 5.17.0 and 5.25.0 (``ATTENTION_ARGUMENTS`` records what they pass).
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from ..api import flash_attn_with_kvcache
from ..compat import is_compiling
from ..reference import masked_softmax
from ..validate import MAX_HEADDIM, SUPPORTED_DTYPES

#: Most new tokens of a sequence on the decode path (the TileLang kernels' limit); more go to prefill.
MAX_DECODE_QUERY = 16
#: The ``attn_implementation`` name of each flashdecode backend.
NAMES = {"auto": "fdecode", "tilelang": "fdecode_tilelang", "triton": "fdecode_triton",
         "reference": "fdecode_reference"}
#: The keyword arguments transformers (5.17.0, 5.25.0) passes the attention function of Llama, Qwen2,
#: Mistral, Gemma-2 and gpt-oss beyond (module, query, key, value, attention_mask); tests check it stays so.
ATTENTION_ARGUMENTS = frozenset(("dropout", "scaling", "sliding_window", "softcap", "s_aux", "position_ids"))
#: Models whose layers read the attention mask themselves as a 4D tensor (sparse-attention indexers:
#: DeepSeek-V3.2/V4, GLM-MoE-DSA, ...; Doge's dynamic mask; Kolibri's index pooling), found by running
#: transformers 5.25's causal LMs on the backend (2026-12-06): they get SDPA's mask (``decode_mask``).
MASK_READING_MODELS = frozenset(("doge", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "axk2", "hy_v4",
                                 "hy_v4_vl_text", "mistral_large4_text", "kolibri1_1", "qwen4_exp_text",
                                 "dots3_note_text"))
#: Keywords a model hands attention functions other than eager and SDPA (which get it folded into
#: the mask or not at all) that the call cannot take: refused with why, never dropped.
REFUSED_ARGUMENTS = {
    "sinks": "sink logits per token (Inkling-2): the call takes one sink logit per head (s_aux)",
}
#: The keywords ``attention_forward`` looks at beyond its parameters, checked at once per call
#: (``indices``, ``block_indices``: the keys or key blocks a sparse-attention indexer kept, folded into
#: SDPA's mask: ``with_selected_keys``).
UNCOMMON_ARGUMENTS = frozenset(REFUSED_ARGUMENTS) | {"position_bias", "indices", "block_indices"}
#: The kernels-format package the paged path loads (``paged_kernel``): a repo id with "flash" and a
#: version digit in it, as transformers' block-table gate asks, and its folder in this package.
PAGED_KERNEL_REPO = "flashdecode/flash-attn2"
PAGED_KERNEL_PATH = os.path.join(os.path.dirname(__file__), "hf_kernel")


def register(backend: str = "auto") -> str:
    """Register flashdecode's attention (on ``backend``) with transformers' attention and mask
    interfaces; returns the name to pass as ``attn_implementation=``."""
    if backend not in NAMES:
        raise ValueError(f"backend must be one of {sorted(NAMES)}, got {backend!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAMES[backend], functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(NAMES[backend], decode_mask)
    return NAMES[backend]


def decode_mask(*args, **kwargs):
    """transformers' mask function for flashdecode: for decode steps (``q_length`` at most
    MAX_DECODE_QUERY, after keys already cached) the visible key range of each sequence as an int32
    (2 or 3, batch, 1, 1) tensor (``key_bounds``, the layer's window from ``local_size``), the third
    row (the window) where a window shapes the rows of several new tokens, which the call must then
    be given; SDPA's mask for longer queries, several new tokens with no key cached before them
    (``kv_length == q_length``: a prefill into a DynamicCache or without a cache, right-padded or
    packed sequences included; a StaticCache's is ``max_cache_len``), several new tokens of a
    chunked layer or of a model with KV-shared layers (Gemma-4 slices the mask's rows), a model that
    reads the mask itself (``reads_the_mask``), a bidirectional mask, and a CPU mask that no bounds
    hold (``key_bounds``; on a GPU the host does not read the mask: such sequences give NaN rows)."""
    from transformers.masking_utils import sdpa_mask

    window, config, q_length = kwargs.get("local_size"), kwargs.get("config"), kwargs["q_length"]
    # only bidirectional masks' makers (create_bidirectional_mask and its sliding-window kin) pass
    # allow_is_bidirectional_skip (transformers 5.17, 5.25): rows that see later keys, which no key bounds hold
    if (q_length > MAX_DECODE_QUERY or reads_the_mask(config) or "allow_is_bidirectional_skip" in kwargs
            or q_length > 1 and (kwargs.get("kv_length") == q_length or chunked(config, window)
                                 or getattr(config, "num_kv_shared_layers", 0))):
        return sdpa_mask(*args, **kwargs)
    mask = sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})
    bounds = key_bounds(mask, window)
    if bounds.device.type == "cpu" and readable(bounds) and not holds(bounds):
        return mask  # (one no bounds hold is no mask transformers would skip)
    if window is not None and q_length > 1:  # one row: its range already starts inside the window
        bounds = torch.cat((bounds, torch.full_like(bounds[:1], window)))
    # 4D, as a mask made ahead must be to pass create_causal_mask as it is (generate over a StaticCache
    # makes each step's mask before the forward, which would read a 2D one as a padding mask)
    return bounds[..., None, None]


def reads_the_mask(config) -> bool:
    """Whether the model's own code reads or edits the mask: ``MASK_READING_MODELS``, and Falcon's
    ALiBi configs (``alibi``: falcon-rw), which add their bias onto it (transformers refuses these
    for FlashAttention)."""
    return getattr(config, "model_type", None) in MASK_READING_MODELS or bool(getattr(config, "alibi", False))


def chunked(config, size: int | None) -> bool:
    """Whether a mask of ``local_size`` ``size`` is of chunked attention (Llama 4's layers of
    ``attention_chunk_size``): among several new tokens a chunk's start gives rows different first
    keys, which one call cannot take, so such steps get SDPA's mask."""
    return (size is not None and getattr(config, "attention_chunk_size", None) == size
            and "chunked_attention" in (getattr(config, "layer_types", None) or ()))


def key_bounds(mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The first and one past the last key any query row of each sequence sees, as an int32
    (2, batch) tensor, from a 4D mask (batch, 1, q_len, kv_len) (boolean, True: visible; or
    additive, 0: visible, the dtype's lowest or -inf: not). The call reproduces the mask of
    generation (left padding, causal rows aligned to the last key, a ``window`` of keys a row):
    a sequence whose mask it cannot (keys with holes, right padding, other rows, chunks, an additive
    bias) gets a first key past its end (``holds``: False), which the call answers with NaN rows:
    never a silently wrong result, and no host sync."""
    if mask.dtype == torch.bool:
        visible, biased = mask[:, 0], None
    else:
        visible = mask[:, 0] == 0
        biased = ~visible & (mask[:, 0] > torch.finfo(mask.dtype).min)
    q_len, kv_len = visible.shape[-2:]
    positions = torch.arange(kv_len, device=mask.device)
    seen = visible.any(dim=1)
    first = torch.where(seen, positions, kv_len).amin(-1)
    end = torch.where(seen, positions + 1, 0).amax(-1)
    # what the call shows row i: keys [first, last_i) (with a window, the last ``window`` of them)
    last = end[:, None] - q_len + torch.arange(1, q_len + 1, device=mask.device)
    lowest = first[:, None] if window is None else torch.maximum(first[:, None], last - window)
    shown = (positions >= lowest[..., None]) & (positions < last[..., None])
    unlike = (shown != visible).flatten(1).any(-1)
    if biased is not None:
        unlike |= biased.flatten(1).any(-1)
    first = torch.where(unlike, kv_len + 1, first)
    return torch.stack((first, end)).to(torch.int32)


def holds(bounds: torch.Tensor) -> bool:
    """Whether ``key_bounds``' bounds hold every sequence's mask (a host read of them); a sequence
    that sees no key (first = kv_len, end = 0) counts as one they cannot."""
    return bool((bounds[0] <= bounds[1]).all())


def readable(tensor: torch.Tensor) -> bool:
    """Whether the host may read ``tensor`` now: on the CPU, or on a GPU outside a CUDA graph's
    capture; never while torch.compile traces."""
    return not is_compiling() and (tensor.device.type == "cpu" or not torch.cuda.is_current_stream_capturing())


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, s_aux=None, backend="auto", kernel=None, **kwargs):
    """transformers' attention interface: query (batch, heads, q_len, head_dim), key and value
    (batch, kv_heads, kv_len, head_dim), the whole cache after this step's update; ``s_aux``: a
    sink logit per head (gpt-oss); returns ((batch, q_len, heads, value head_dim), None).
    ``kernel``: what to call in place of flashdecode's ``flash_attn_with_kvcache`` (same arguments;
    the decode-step benchmark times FlashAttention 2's over the same cache view).

    What the kernels cannot take goes to SDPA: prefill without softcap or sinks, steps whose query,
    key or value needs a gradient (grad enabled: the call keeps none), head dims above
    ``MAX_HEADDIM`` (Gemma-4's global layers), a float32 model, a window the model builds into its
    masks but does not pass (Qwen2-MoE), a ``position_bias`` on the scores (Inkling) and the keys a
    sparse-attention indexer kept (``indices``: DeepSeek-V3.2 and kin; ``block_indices``: MiniMax-M3;
    folded into the mask as transformers does for SDPA); of these, steps with softcap or sinks, which
    SDPA cannot run, go to float32 PyTorch (``pytorch_attention``) but a ``position_bias`` with them
    raises ValueError, as ``REFUSED_ARGUMENTS`` (sinks per token) do. Float32 PyTorch also runs a
    prefill with softcap or sinks over a mask the call cannot hold (right padding) where the host may
    read the mask (``readable``; under a CUDA graph's capture or torch.compile such sequences give
    NaN rows). A value head
    dim below the query's (MLA: DeepSeek-V2/V3) is padded with zeros for the call and cropped from
    its output, as transformers' FlashAttention path does."""
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported by flashdecode (it never forms the weights)")
    biased = False  # a position_bias on the scores (Inkling): SDPA adds it
    indices = block_indices = None  # the keys (key blocks) a sparse-attention indexer kept: folded into the mask
    if not UNCOMMON_ARGUMENTS.isdisjoint(kwargs):  # one check on the common path: none of these passed
        for name in REFUSED_ARGUMENTS:
            if kwargs.get(name) is not None:
                raise ValueError(f"{name}: flashdecode cannot take {REFUSED_ARGUMENTS[name]}")
        biased = kwargs.get("position_bias") is not None
        indices, block_indices = kwargs.pop("indices", None), kwargs.pop("block_indices", None)
    selected = indices is not None or block_indices is not None
    decode = attention_mask is not None and attention_mask.dtype == torch.int32
    if decode:  # decode_mask's bounds, (rows, batch, 1, 1), as (rows, batch): one op (~1.5 us on a CPU)
        attention_mask = attention_mask.flatten(1)
    windowed = decode and len(attention_mask) == 3  # decode_mask's window over several new tokens
    wide = query.shape[-1] > MAX_HEADDIM
    full = query.dtype not in SUPPORTED_DTYPES  # a float32 model: SDPA
    # training: the call keeps no gradient, SDPA and PyTorch do (decode loops: under no_grad or inference_mode)
    trains = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    off_call = (wide or full or biased or selected or trains or windowed and sliding_window is None
                or not decode and (softcap is None and s_aux is None or not is_causal(module, kwargs)))
    bounds = attention_mask  # decode_mask's bounds, SDPA's mask or none
    if not (off_call or decode or attention_mask is None):  # a prefill with softcap or sinks: SDPA's mask as bounds
        bounds = key_bounds(attention_mask, sliding_window)
        # one the call cannot hold (right padding, packed sequences): float32 PyTorch, where the host may read them
        off_call = readable(bounds) and not holds(bounds)
    if dropout and (not off_call or softcap is not None or s_aux is not None):
        raise ValueError(f"dropout must be 0 on flashdecode's path and with softcap or sinks, got {dropout}")
    if off_call:  # over SDPA's form of the mask; decode_mask's bounds give NaN rows where they cannot hold it
        mask = bounds_mask(attention_mask, query.shape[2], key.shape[2]) if decode else attention_mask
        if selected:
            mask = with_selected_keys(module, mask, query, key, indices, block_indices, kwargs.get("position_ids"))
        if softcap is not None or s_aux is not None:
            if biased:
                raise ValueError("position_bias adds to the scores, which the call cannot; with softcap or sinks "
                                 "SDPA cannot stand in for the call")
            out, weights = pytorch_attention(query, key, value, mask, is_causal(module, kwargs), scaling, softcap,
                                             s_aux), None
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            out, weights = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                                  **kwargs)
        return (unheld_as_nan(out, attention_mask) if decode else out), weights
    # decode_mask's bounds (a third row, the window, only where the call applies sliding_window itself)
    if windowed:
        bounds = bounds[:2]
    first, end = (None, None) if bounds is None else bounds.unbind()  # one op: iterating costs ~2 us more
    if bounds is None and query.shape[2] > 1:  # no mask: SDPA's is_causal rows, keys 0..i (pytorch_attention)
        end = query.shape[2]
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    value_dim = value.shape[-1]
    if value_dim < key.shape[-1]:  # MLA: zeros up to the query's head dim, cropped from the output below
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - value_dim))
    # q (batch, q_len, heads, head_dim): a copy only where a model's q is heads-first in memory and q_len > 1
    # (its prefill through flashdecode; TileLang takes contiguous queries), never the cache
    out = (kernel or flash_attn_with_kvcache)(
        query.transpose(1, 2).contiguous(), key.transpose(1, 2), value.transpose(1, 2), cache_seqlens=end,
        cache_leftpad=first, softmax_scale=scaling, causal=True, window_size=window, softcap=softcap or 0.0,
        backend=backend, sinks=None if s_aux is None else s_aux.float())
    return (out if out.shape[-1] == value_dim else out[..., :value_dim]), None


def with_selected_keys(module, mask, query, key, indices=None, block_indices=None, position_ids=None):
    """SDPA's 4D ``mask`` (for decode steps ``bounds_mask``'s), boolean or additive, with only the keys
    a sparse-attention indexer kept left visible, as these models fold them for transformers' eager
    and SDPA paths: ``indices`` (batch, q_len, top-k: positions in the cache for each row;
    DeepSeek-V3.2, GLM-MoE-DSA, ...) here; ``block_indices`` (MiniMax-M3: key blocks a KV head) by
    the model's own ``module.indexer.build_block_mask``, over SDPA's rows (``position_ids``: the
    model's, else the last q_len positions, as the model takes them). ``indices`` without a mask
    raise ValueError naming attention_mask (their models' indexers read it: ``MASK_READING_MODELS``)."""
    if mask is None and indices is not None:
        raise ValueError("attention_mask: a selection of keys (indices) needs SDPA's 4D mask, got none")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if block_indices is not None:
        build = getattr(getattr(module, "indexer", None), "build_block_mask", None)
        if build is None:
            raise ValueError("block_indices: key blocks are folded by the layer's indexer.build_block_mask "
                             "(MiniMax-M3), which this layer lacks")
        if position_ids is None:
            position_ids = torch.arange(kv_len - q_len, kv_len, device=query.device)
        position_ids = (position_ids if position_ids.ndim > 1 else position_ids[None]).expand(batch, -1)
        return build(block_indices, mask, kv_len, query.dtype, query.device, position_ids)
    kept = torch.zeros(batch, q_len, kv_len, dtype=torch.bool, device=mask.device)
    kept = kept.scatter(-1, indices.long(), True)[:, None]
    return mask & kept if mask.dtype == torch.bool else mask.masked_fill(~kept, torch.finfo(mask.dtype).min)


def bounds_mask(bounds: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """The boolean (batch, 1, q_len, kv_len) mask that ``decode_mask``'s bounds (first key, end and,
    where a window shapes the rows, the window: int32 (2 or 3, batch)) stand for: row i sees
    [first, end - q_len + i + 1), its last ``window`` keys where there is one. Built from tensors:
    no host sync."""
    first, end = bounds[:2].long()[..., None]
    positions = torch.arange(kv_len, device=bounds.device)
    last = end - q_len + torch.arange(1, q_len + 1, device=bounds.device)
    lowest = first if len(bounds) == 2 else torch.maximum(first, last - bounds[2].long()[:, None])
    return ((positions >= lowest[..., None]) & (positions < last[..., None]))[:, None]


def is_causal(module, kwargs) -> bool:
    """Whether a step's rows see no later key, as SDPA's path decides it: the ``is_causal`` a model
    passes, else its attention module's (bidirectional encoders: False)."""
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else bool(causal)


def pytorch_attention(query, key, value, attention_mask, causal, scaling, softcap, sinks):
    """``attention_forward``'s steps with softcap or sinks that the call cannot take (head dims
    above MAX_HEADDIM, float32 models, a window not passed, rows that see later keys, steps that keep
    a gradient, prefills over a mask no key bounds hold), in float32
    PyTorch (``_masked_attention``) a sequence at a time: over SDPA's boolean mask (decode_mask's
    bounds made one by ``bounds_mask``) or, where transformers skipped it (None), SDPA's
    ``is_causal`` rows: aligned to the first key (transformers skips the mask only where that is
    right: as many keys as rows, or a prefill into an empty StaticCache, whose later slots are
    empty), row i sees keys 0..i; one row, or a step that is not causal, every key. Returns
    (batch, q_len, heads, value head dim) in query's dtype."""
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    if attention_mask is None:
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
        visible = (visible.tril() if causal and q_len > 1 else visible).expand(batch, q_len, kv_len)
    elif attention_mask.dtype == torch.bool:
        visible = attention_mask[:, 0].expand(batch, q_len, kv_len)
    else:
        raise ValueError(f"attention_mask: with softcap or sinks outside the call, a boolean mask is needed, "
                         f"got {attention_mask.dtype}")
    return torch.stack([_masked_attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1),
                                          visible[b], scaling, softcap, sinks) for b in range(batch)])


def unheld_as_nan(out: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``out`` (batch, q_len, heads, head dim) of a decode step run off the call over ``bounds_mask``,
    with NaN rows for each sequence whose mask the bounds cannot hold (``key_bounds``: a first key past
    its end), as the call gives them; SDPA and PyTorch would give such rows, which see no key, zeros."""
    return out.masked_fill((bounds[0] > bounds[1])[:, None, None, None], float("nan"))


def kvcache_attention(*args, s_aux=None, **kwargs):
    """``flash_attn_with_kvcache`` for the paged path, taking transformers' name for attention
    sinks: ``s_aux``, a logit per query head in any float dtype (gpt-oss), goes as ``sinks``; the
    ``max_seqlen_q`` transformers 5.25's block-table decode passes beside a dense q (the call takes
    it only with ``cu_seqlens_q``, as FlashAttention 3 reads it) is dropped."""
    if s_aux is not None:
        kwargs["sinks"] = s_aux.float()
    if kwargs.get("cu_seqlens_q") is None:
        kwargs.pop("max_seqlen_q", None)
    return flash_attn_with_kvcache(*args, **kwargs)


# transformers passes only the keywords a kernel's signature names (block_table, s_aux, ...)
kvcache_attention.__signature__ = inspect.signature(flash_attn_with_kvcache).replace(parameters=[
    *inspect.signature(flash_attn_with_kvcache).parameters.values(),
    inspect.Parameter("s_aux", inspect.Parameter.KEYWORD_ONLY, default=None)])


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, s_aux=None, **unused):
    """FlashAttention 2's ``flash_attn_varlen_func``, for the paged path's prefill: q (total_q,
    heads, head_dim) and k, v (total_k, kv_heads, head_dim) pack the sequences that
    ``cu_seqlens_q``/``cu_seqlens_k`` (int32 (batch + 1,)) delimit; causal masks are bottom-right
    aligned. One masked SDPA call, built from tensors only (no host sync); with ``softcap`` or
    sinks (``s_aux``, a logit per head), which SDPA cannot run, the same attention in float32
    PyTorch. Rows outside every sequence (padding) give zeros. Returns (total_q, heads, head_dim)."""
    if dropout_p:
        raise ValueError(f"dropout_p must be 0, got {dropout_p}")
    batch = cu_seqlens_q.shape[0] - 1

    def sequence_and_distance_to_end(total, cu_seqlens):
        index = torch.arange(total, device=cu_seqlens.device)
        sequence = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)
        end = cu_seqlens[1:].long()[sequence.clamp(max=batch - 1)]
        return sequence, end - index  # 1 for a sequence's last token

    sequence_q, to_end_q = sequence_and_distance_to_end(q.shape[0], cu_seqlens_q)
    sequence_k, to_end_k = sequence_and_distance_to_end(k.shape[0], cu_seqlens_k)
    behind = to_end_k[None, :] - to_end_q[:, None]  # query position minus key position
    visible = (sequence_q[:, None] == sequence_k[None, :]) & (sequence_q[:, None] < batch)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        visible &= behind <= left
    if right >= 0:
        visible &= behind >= -right
    if softcap or s_aux is not None:
        out = _masked_attention(q, k, v, visible, softmax_scale, softcap, s_aux)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=visible,
            scale=softmax_scale, enable_gqa=True)[0].transpose(0, 1)
    return out.masked_fill(~visible.any(-1)[:, None, None], 0)


#: float32 scores ``_masked_attention`` computes at once (256 MiB; its softmax holds a few arrays of
#: that size): long prefills go a block of query rows at a time.
MASKED_ATTENTION_SCORES = 1 << 26


def _masked_attention(q, k, v, visible, scale, softcap, sinks):
    """Attention of q (Tq, H, D) over k, v (Tk, Hk, D) where ``visible`` (Tq, Tk), in float32: scores
    soft-capped (``softcap`` > 0), then the reference's masked softmax (``reference.masked_softmax``:
    each row's denominator joined by its head's sink logit; a row without keys gives 0). Query head
    h reads KV head h // (H / Hk); K and V are not repeated per head. Rows go in blocks of at most
    MASKED_ATTENTION_SCORES scores (sizes from shapes: no host sync)."""
    heads_k = k.shape[1]
    group = q.shape[1] // heads_k
    k, v = k.float(), v.float()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sink = None if sinks is None else sinks.float().view(heads_k, group, 1)
    rows = max(1, MASKED_ATTENTION_SCORES // max(1, q.shape[1] * k.shape[0]))
    out = []
    for first in range(0, q.shape[0], rows):
        block = q[first:first + rows].float().unflatten(1, (heads_k, group))  # (rows, Hk, G, D)
        scores = torch.einsum("rkgd,tkd->kgrt", block, k).mul_(scale)
        if softcap:  # tanh's output is kept as it is: autograd saves it for a backward pass
            scores = torch.tanh(scores.div_(softcap)) * softcap
        weights, _ = masked_softmax(scores, visible[first:first + rows], sink)
        out.append(torch.einsum("kgrt,tkd->rkgd", weights, v).flatten(1, 2))
    return torch.cat(out).to(q.dtype)


def paged_kernel() -> str:
    """Make the kernels-format package of the paged path loadable offline and return the
    ``attn_implementation`` name that selects it (e.g. for ``generate_batch``).

    transformers' continuous batching runs decode-only batches through a kernel package's
    ``flash_attn_with_kvcache`` over the block table (on CUDA, for models without sliding windows),
    and only for names that ask for FlashAttention 2 or 3; the package here (``hf_kernel/``) is that
    call of flashdecode's, the other batches on SDPA (``varlen_attention``). The ``kernels`` library
    loads it through ``LOCAL_KERNELS``. gpt-oss cannot take it: transformers swaps any "flash" name
    for its own kernel there (``docs/integrations.md``)."""
    entry = f"{PAGED_KERNEL_REPO}={PAGED_KERNEL_PATH}"
    current = os.environ.get("LOCAL_KERNELS")
    if current is None:
        os.environ["LOCAL_KERNELS"] = entry
    elif entry not in current.split(":"):
        os.environ["LOCAL_KERNELS"] = f"{current}:{entry}"
    return PAGED_KERNEL_REPO
