"""Tiny random Hugging Face models built and saved locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import TINY_LLAMA

# the shape shared with bench/common.py's TINY_LLAMA (the one source of the tiny llama config)
COMMON = {k: TINY_LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim",
                                     "max_position_embeddings")}
COMMON["initializer_range"] = 0.2  # large enough that logits are far from uniform


def hf_config(family: str, **overrides):
    """A tiny transformers config of ``family`` (llama, qwen3, qwen3_moe)."""
    import transformers as tf

    kw = dict(COMMON)
    if family == "llama":
        kw["rope_parameters"] = dict(TINY_LLAMA["rope_parameters"])
        cls = tf.LlamaConfig
    elif family == "qwen3":
        cls = tf.Qwen3Config
    elif family == "qwen3_moe":
        kw.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        cls = tf.Qwen3MoeConfig
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A random-weight transformers causal LM in fp32, eval mode, eager attention."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    cfg._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def save_hf_model(model, path: Path, max_shard_size: str | None = None) -> Path:
    """Save with safetensors (sharded with an index when ``max_shard_size`` is given)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return path


def random_sequences(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
