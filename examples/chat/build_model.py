#!/usr/bin/env python3
"""Builds a tiny Llama-architecture model in a directory, offline, in ~10 s:
a byte-level BPE tokenizer trained with `tokenizers` on local text, a
LlamaConfig (4 layers, hidden 256, 4 heads, 2 kv heads, float32) with random
weights, `save_pretrained` for both, and a chat template.

Its output is gibberish; its KV cache is real, which is what the chat example
and the end-to-end test exercise.

    python examples/chat/build_model.py DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Bump when anything below changes the model, so old builds are replaced.
BUILD_VERSION = 1
VOCAB = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def training_text() -> list[str]:
    """Local text only: this repository's LICENSE (Apache-2.0, fixed) and a
    few standard-library modules, so a fresh machine trains the same BPE."""
    import argparse as a
    import json.decoder as j
    import textwrap as t

    out = []
    for p in (os.path.join(REPO, "LICENSE"), a.__file__, t.__file__, j.__file__):
        try:
            with open(p, encoding="utf-8") as f:
                out.append(f.read())
        except OSError:
            pass
    return out


def is_built(d: str) -> bool:
    try:
        with open(os.path.join(d, "fx_build.json")) as f:
            return json.load(f).get("version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def build(d: str, force: bool = False, seed: int = 0) -> str:
    d = os.path.abspath(d)
    if is_built(d) and not force:
        return d
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = d + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", model_max_length=8192
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Larger than default init so the logits are spread out: greedy tokens are
    # well separated and log-probs show differences clearly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "fx_build.json"), "w") as f:
        json.dump({"version": BUILD_VERSION, "seed": seed}, f)
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    was = is_built(args.dir) and not args.force
    d = build(args.dir, args.force)
    print(f"model: {d} ({'already built' if was else 'built'})")


if __name__ == "__main__":
    sys.exit(main())
