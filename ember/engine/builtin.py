"""Ember's built-in tiny model: random weights and a byte-level BPE tokenizer, built locally.

``ember serve`` with no ``--model`` serves it, so the service runs on a fresh machine with nothing
downloaded. The folder is a normal Hugging Face model folder (``config.json``, safetensors, tokenizer
files): transformers loads it, and the Tinker SDK loads its tokenizer offline by path
(``get_info().model_data.tokenizer_id``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

BUILTIN_NAME = "ember-tiny-qwen3"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen's instruct models use it (what chat clients of the OpenAI-compatible endpoint get)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# A small English corpus for the BPE merges (the tokenizer only needs to be valid and deterministic).
_CORPUS = """
User: What is a learning rate? Assistant: The learning rate scales each optimizer step.
User: How do I fine-tune a model? Assistant: Collect examples, pick a loss, and train an adapter.
A LoRA adapter adds two small matrices to a frozen weight; only the small matrices are trained.
Many users can share one base model: their adapters train in the same packed batches.
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14 2.71 42. Questions? Answers! (yes) [no] {maybe}
Training loss goes down when the model learns; sampling draws tokens from the model's distribution.
Reinforcement learning uses rewards and advantages; supervised learning uses targets and weights.
def main():\n    print("hello, world")\n    return 0\n
Once upon a time there was a tiny model that learned to count, to spell and to answer questions.
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it with
    ``PreTrainedTokenizerFast.save_pretrained``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(fast)


def build_model(
    out_dir: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    tokenizer_vocab: int = 512,
    **overrides,
) -> Path:
    """A random-weight ``family`` model (qwen3, qwen3_moe or llama) plus a local tokenizer in
    ``out_dir``; the model's vocabulary covers the tokenizer's."""
    import torch
    import transformers as tf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_tok = build_tokenizer(out_dir, tokenizer_vocab)
    vocab = max(overrides.pop("vocab_size", 0), -(-n_tok // 64) * 64)
    common = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "bos_token_id": None,
        "pad_token_id": 0,
    }
    if family == "qwen3_moe":
        common.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    common.update(overrides)
    cls = {"qwen3": tf.Qwen3Config, "qwen3_moe": tf.Qwen3MoeConfig, "llama": tf.LlamaConfig}[family]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cls(**common), dtype=torch.float32)
    model.save_pretrained(str(out_dir))
    return out_dir


def ensure_builtin(home: str | Path) -> Path:
    """The built-in model folder under ``home`` (built on first use, atomically)."""
    target = Path(home).expanduser() / "models" / BUILTIN_NAME
    if (target / "config.json").is_file():
        return target
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        build_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # built concurrently by another process: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    import sys

    print(ensure_builtin(sys.argv[1] if len(sys.argv) > 1 else "~/.ember"))
