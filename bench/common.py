"""Shared pieces of the GPU benchmarks: model shapes, timing, FLOP counts, hardware line, and the
transformers + PEFT baseline built over an Ember model's weights."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch

# ---------------------------------------------------------------------------------------------
# Full-size shapes (HF ``config.json`` fields, random weights). Each fits one 141 GB H200 in bf16
# with room for a LoRA training step; families whose real model does not fit get a layer-reduced
# shape: the real widths with fewer layers (name suffix ``-<n>l``). "Measured" peaks: Ember
# ``bench/train_step.py --only ember-1`` (rank 32, 8 x 2048 tokens) on the H200, 2026-11-30.
# ---------------------------------------------------------------------------------------------

# Qwen3-8B shape (shared/perf_targets.md), random weights.
QWEN3_8B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
}

# Qwen3-30B-A3B shape.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
}

# Olmo 3 7B (allenai/Olmo-3-1025-7B), all 32 layers: ~7.3 B parameters, 14.6 GB in bf16. Widths,
# MHA (32 KV heads), the 3 sliding (4096) : 1 full layer pattern, rope theta 5e5 and the YaRN x8
# (from 8192) on the full-attention layers as in OLMo-core's olmo3_7B and public copies of the
# released config.json (legacy rope_theta + rope_scaling form, which both transformers and Ember read
# as "YaRN on full-attention layers only"). vocab_size 100278 is the Dolma-2 tokenizer's real size
# as we remember the HF config (OLMo-core pads the embedding to 100352 rows): unverified here, and
# immaterial to step time. Measured peak 88.6 GiB in one pass.
OLMO3_7B = {
    "model_type": "olmo3",
    "vocab_size": 100278,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "attention_bias": False,
    "eos_token_id": 100257,
    "pad_token_id": 100277,
    "tie_word_embeddings": False,
}

# GLM-4.7-Flash (zai-org/GLM-4.7-Flash, transformers ``glm4_moe_lite``), all 47 layers: ~30 B
# parameters (~3 B active), ~60 GB in bf16. MLA (q_lora 768, kv_lora 512, d_nope 192, d_rope 64,
# d_v 256, 20 heads), 64 routed experts top-4 + 1 shared, noaux_tc sigmoid router (one group),
# routed scale 1.8, layer 0 dense: shared/spec/models_and_rl.md §4.1 table, the transformers 5.23
# Glm4MoeLiteConfig defaults and public copies of the released config.json agree on all of these.
# rope theta 1e6 (spec; transformers' default is 1e4) and rms_norm_eps 1e-5 are from the released
# config as copied publicly; the MTP layer (num_nextn_predict_layers 1) is not part of the model.
# 8 x 2048 tokens in one pass runs out of memory; with --micro 4 the measured peak is 89.6 GiB.
GLM_4_7_FLASH = {
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.8,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense"] + ["sparse"] * 46,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_interleave": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": [154820, 154827, 154829],
    "pad_token_id": 154820,
    "tie_word_embeddings": False,
}

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3, 61 layers: 671.0 B by Ember's count, ~1.3 TB in bf16, does not
# fit), LAYER-REDUCED
# to 4 layers: the 3 dense layers (first_k_dense_replace) + 1 MoE layer, real widths: ~15 B
# parameters, ~30 GB in bf16. Widths, MLA, 256 routed experts top-8 in 8 groups (4 kept) + 1 shared,
# scale 2.5, vocab and YaRN x40 (from 4096, mscale = mscale_all_dim = 1): shared/spec §4.1 table and
# transformers 5.23 DeepseekV3Config defaults; the YaRN parameters and max_position_embeddings 163840
# are the released config.json's as we know them. MTP layer (61) not included. (On the H200 on
# 2026-11-30 Ember's step failed in attention, "v must have shape (total_k, num_heads_k,
# head_size_og)": the varlen kernel with d_v 128 != d_qk 192; GLM-4.7-Flash has d_v = d_qk.)
DEEPSEEK_V3_4L = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "head_dim": 64,  # = qk_rope_head_dim, as transformers writes it
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 3,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-*, 48 layers: 79.7 B parameters by Ember's count, ~160 GB
# in bf16, does not fit),
# LAYER-REDUCED to 8 layers (two of its 3 Gated-DeltaNet : 1 gated-attention groups), real widths:
# ~13.6 B parameters, ~27 GB in bf16. Values: transformers 5.23 Qwen3NextConfig defaults (which are
# this model's), with the released config's rope theta 1e7 (the default is 1e4); intermediate_size
# 5120 is the released value as we remember it and unused (every layer is MoE). Measured peak
# 85.2 GiB in one pass.
QWEN3_NEXT_80B_A3B_8L = {
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "full_attention_interval": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
}

# Qwen3.8-Flash-Next (Qwen/Qwen3.8-Flash-Next, transformers ``qwen4_exp``; 48 layers: 125.7 B
# parameters + the 51.2 B n-gram table = 176.9 B by Ember's count, cf. the spec's "125 B" / "176 B"
# model-card figures; does not fit), LAYER-REDUCED to 8 layers (two 3 GDN : 1
# QSA-attention groups), real widths: ~21.7 B parameters, ~43 GB in bf16. Values: the released text
# config as given in shared/spec/models_and_rl.md §3.1 (hidden 2560, 24/2 heads x 256, GDN 16/48
# heads x 128 with a sigmoid output gate, 512 experts top-10 x 640 + shared 640, 4 hyper-connection
# streams of rank 320, QSA indexer 4 heads x 128 with budget 2048 / blocks of 4, rope theta 1e7 on a
# quarter of head_dim; text-only, so the interleaved MRoPE sections reduce to 1-D rope and are left
# out). NOT as released: ``ple_layer_ids`` is empty. The real model reads its 51.2 B-parameter
# (95 GiB bf16) hashed n-gram table (PLE) at layer 2. Ember keeps that table in host memory
# (ember.core.layers.ngram_memory), but the HF baseline holds it on the device, where it would not
# leave room for a training step; the bench leaves it out for both. The tiny-qwen4-exp shape has a PLE layer.
# 8 x 2048 tokens in one pass runs out of memory; with --micro 4 the measured peak is 74.8 GiB.
QWEN3_8_FLASH_NEXT_8L = {
    "model_type": "qwen4_exp_text",
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 8,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "output_gate_type": "sigmoid",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "norm_topk_prob": True,
    "hc_count": 4,
    "hc_lowrank": 320,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "ple_layer_ids": [],
    "ple_embed_dim": 2560,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20000000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "split_ngram_parts": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "eos_token_id": 248044,
    "tie_word_embeddings": False,
}

# Inkling-2-Small (thinkingmachines/Inkling-2-Small, transformers ``inkling2``; 594 B total / 17 B
# active, 48 layers, ~1.2 TB in bf16: does not fit), LAYER-REDUCED to 3 layers, real widths: ~38.8 B
# parameters, ~78 GB in bf16 (each layer's 384 experts alone are 12.2 B). Values: transformers 5.23
# Inkling2TextConfig defaults, which we take to be the released model's (not checked against its
# config.json): with 48 layers Ember builds 593.7 B parameters (~18.9 B matmul parameters per token,
# LM head included) for the stated 594 B / 17 B, and they have its window 1024, d_rel 16, 384
# experts top-8 and softcap 30 (shared/spec/models_and_rl.md §2.1; its §2.7 lists the other values
# as still to be read from the checkpoint). Layer types: two sliding-window layers and one global layer (the real
# pattern is 5 sliding : 1 global; 6 layers would not leave room for a training step), so the
# 6-layer attention-residual block is cut after 3 layers. Measured peak 121.5 GiB in one pass (the
# first step took 210 s, mostly before the GPU got busy).
INKLING2_SMALL_3L = {
    "model_type": "inkling2_text",
    "vocab_size": 201024,
    "unpadded_vocab_size": 200058,
    "hidden_size": 4608,
    "num_hidden_layers": 3,
    "layer_types": ["hybrid_sliding", "hybrid_sliding", "hybrid"],
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "swa_num_attention_heads": 48,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 128,
    "sliding_window_size": 1024,
    "d_rel": 16,
    "rel_extent": 1024,
    "log_scaling_n_floor": 128000,
    "log_scaling_alpha": 0.1,
    "conv_kernel_size": 4,
    "moe_intermediate_size": 2304,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "route_scale": 8.0,
    "scoring_func": "sigmoid",
    "qk_l2_clip_threshold": 22.627416997969522,
    "rel_l2_clip_threshold": 8.0,
    "n_layers_per_attn_res_block": 6,
    "mlp_gate_softcap": 4.0,
    "mlp_up_softcap": 25.0,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 200006,
    "tie_word_embeddings": False,
}

# ---------------------------------------------------------------------------------------------
# Tiny CPU smoke shapes, one per family. Except TINY / TINY_MOE (the original smoke shapes), these
# are the one source of the tiny configs the parity tests build and check against transformers:
# the test file named above each imports its config from here (adding initializer_range, and
# overriding or leaving out the odd field where noted there), so every one is known to build;
# fields transformers' config class would fill with a default that Ember's reader does not share
# are spelled out. TINY_LLAMA's shape and rope are also tests/tiny_models.py's hf_config("llama").
# ---------------------------------------------------------------------------------------------

# qwen3
TINY = {
    "model_type": "qwen3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}

# qwen3_moe
TINY_MOE = {
    **TINY,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}

# llama
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# deepseek_v3: tests/parity/test_deepseek_v3.py's case "deepseek_yarn" (q latent, 4 groups of which
# 2 kept, two shared experts, one dense layer, YaRN with mscale != mscale_all_dim); TINY_MLA is the
# part all that test's cases share (its BASE, with initializer_range)
TINY_MLA = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "max_position_embeddings": 256,
    "norm_topk_prob": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
TINY_DEEPSEEK_V3 = {
    **TINY_MLA,
    "model_type": "deepseek_v3",
    "head_dim": 8,  # = qk_rope_head_dim, as transformers writes it
    "q_lora_rank": 32,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}

# glm4_moe_lite (GLM-4.7-Flash): tests/parity/test_deepseek_v3.py's case "glm4_moe_lite" (dense layers
# from mlp_layer_types, one group, theta 1e6)
TINY_GLM4_MOE_LITE = {
    **TINY_MLA,
    "model_type": "glm4_moe_lite",
    "q_lora_rank": 32,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.8,
    "mlp_layer_types": ["sparse", "dense", "sparse"],
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}

# olmo3: tests/parity/test_olmo3.py build_hf (three sliding-window layers of 8 + one full layer with
# YaRN; legacy rope_theta + rope_scaling form)
TINY_OLMO3 = {
    "model_type": "olmo3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "eos_token_id": 1,
    "rope_theta": 20000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.2,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "tie_word_embeddings": False,
}

# qwen3_next: tests/parity/test_qwen3_next.py build_hf (GDN, attention, GDN with a dense MLP, attention)
_TINY_GDN = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "tie_word_embeddings": False,
}
TINY_QWEN3_NEXT = {
    **_TINY_GDN,
    "model_type": "qwen3_next",
    "intermediate_size": 96,
    "mlp_only_layers": [2],
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
}

# qwen4_exp (Qwen3.8-Flash-Next): tests/parity/test_qwen4_exp.py build_hf (GDN, GDN with the PLE
# n-gram memory, QSA attention with a budget of 8 tokens in 2-token blocks, GDN; 4 residual streams)
TINY_QWEN4_EXP = {
    **_TINY_GDN,
    "model_type": "qwen4_exp_text",
    "hc_count": 4,
    "hc_lowrank": 16,
    "ple_layer_ids": [2],
    "ple_embed_dim": 32,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 50,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 2,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 2,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "eos_token_id": 1,
    "output_gate_type": "sigmoid",
}

# inkling2 (Inkling-2): tests/parity/test_inkling2.py TINY (window 5, global relative extent 12,
# global layers 0 and 5, attention-residual blocks of 3, log scaling from position 4, L2 clips,
# softcaps, padded vocabulary 320 of which 300 are tokens)
TINY_INKLING2 = {
    "model_type": "inkling2_text",
    "vocab_size": 320,
    "unpadded_vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 7,
    "layer_types": ["hybrid"] + ["hybrid_sliding"] * 4 + ["hybrid", "hybrid_sliding"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": 8,
    "sliding_window_size": 5,
    "d_rel": 4,
    "rel_extent": 12,
    "log_scaling_n_floor": 4,
    "log_scaling_alpha": 0.3,
    "qk_l2_clip_threshold": 4.0,
    "rel_l2_clip_threshold": 1.5,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "route_scale": 2.5,
    "n_layers_per_attn_res_block": 3,
    "mlp_gate_softcap": 2.0,
    "mlp_up_softcap": 3.0,
    "final_logit_softcapping": 4.0,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# Every shape the benchmarks accept (--shape), by name.
SHAPES: dict[str, dict] = {
    "qwen3-8b": QWEN3_8B,
    "qwen3-8b-16l": {**QWEN3_8B, "num_hidden_layers": 16},  # full fine-tuning: both optimizer layouts fit
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    # half the layers: the bf16 weights (31 GB) and their fp8 rollout copy (15 GB) fit one H100
    "qwen3-30b-a3b-24l": {**QWEN3_30B_A3B, "num_hidden_layers": 24},
    "olmo3-7b": OLMO3_7B,
    "glm-4.7-flash": GLM_4_7_FLASH,
    "deepseek-v3-4l": DEEPSEEK_V3_4L,
    "qwen3-next-80b-a3b-8l": QWEN3_NEXT_80B_A3B_8L,
    "qwen3.8-flash-next-8l": QWEN3_8_FLASH_NEXT_8L,
    # sampling with the n-gram memory (PLE) at layer 2 as released, its table cut to 16 M rows (2.6 B
    # parameters, 5.1 GB in host memory; the released one has 320 M rows): no training bench uses it
    "qwen3.8-flash-next-8l-ple": {**QWEN3_8_FLASH_NEXT_8L, "ple_layer_ids": [2], "ngram_vocab_size_base": 1_000_000},
    "inkling2-small-3l": INKLING2_SMALL_3L,
    "tiny": TINY,
    "tiny-moe": TINY_MOE,
    "tiny-llama": TINY_LLAMA,
    "tiny-deepseek-v3": TINY_DEEPSEEK_V3,
    "tiny-glm4-moe-lite": TINY_GLM4_MOE_LITE,
    "tiny-olmo3": TINY_OLMO3,
    "tiny-qwen3-next": TINY_QWEN3_NEXT,
    "tiny-qwen4-exp": TINY_QWEN4_EXP,
    "tiny-inkling2": TINY_INKLING2,
}

PEAK_BF16_FLOPS = 790e12  # measured 8192^3 bf16 matmul rate of this H200 (shared/perf_targets.md)
COPY_BANDWIDTH = 4.3e12  # measured device-to-device copy bandwidth of the H200, bytes/s
# the same measured on the H100 machines (the device tool's KINDS.md: about 3.0 TB/s read + write)
H100_COPY_BANDWIDTH = 3.0e12


def copy_bandwidth() -> float:
    """The bandwidth floors' divisor: the measured copy bandwidth of this machine's GPU (an H100's
    where torch names one, else the H200's)."""
    if torch.cuda.is_available() and "H100" in torch.cuda.get_device_name():
        return H100_COPY_BANDWIDTH
    return COPY_BANDWIDTH


def hardware_line() -> str:
    """The GPU line from nvidia-smi (name, memory, driver), or torch's device name."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# nvidia-smi's clocks_throttle_reasons bits that mean power: the software power cap, the hardware power brake
POWER_THROTTLE = 0x4 | 0x80


def parse_gpu_samples(lines: list[str]) -> dict | None:
    """The summary of ``nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active
    --format=csv,noheader,nounits`` lines (one GPU): mean and lowest SM clock (MHz), mean and highest
    power draw (W), and the share of samples the clocks were held down by power
    (:data:`POWER_THROTTLE`). None without a sample."""
    clocks, power, capped = [], [], 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            mhz, watts, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except ValueError:
            continue
        clocks.append(mhz)
        power.append(watts)
        capped += bool(reasons & POWER_THROTTLE)
    if not clocks:
        return None
    return {"sm_mhz_mean": statistics.fmean(clocks), "sm_mhz_min": min(clocks), "power_w_mean": statistics.fmean(power),
            "power_w_max": max(power), "power_capped_share": capped / len(clocks), "samples": len(clocks)}


class GpuMonitor:
    """SM clock, power draw and power-cap throttling of this process's GPU, sampled every
    ``interval_ms`` by ``nvidia-smi`` while the block runs (:attr:`summary`, from
    :func:`parse_gpu_samples`; None without a GPU or nvidia-smi). A decode step that ran at lower
    clocks because the GPU reached its power limit (an H100 at 256 rows: 700 W, SM clocks 1.6-1.9
    GHz instead of 1.98) is slower for a reason no kernel change shows."""

    def __init__(self, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.summary: dict | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        if not torch.cuda.is_available():
            return self
        # nvidia-smi numbers GPUs physically; CUDA_VISIBLE_DEVICES (indices or UUIDs, both taken by
        # --id) maps torch's device numbers onto them
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        index = torch.cuda.current_device()
        gpu = visible[index] if index < len(visible) else str(index)
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--id={gpu}", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.summary = parse_gpu_samples(out.splitlines())

    @staticmethod
    def line(summary: dict | None) -> str:
        """``summary`` in a few words for a report line ('' for None)."""
        if not summary:
            return ""
        return (f"SM {summary['sm_mhz_mean']:.0f} MHz (lowest {summary['sm_mhz_min']:.0f}), "
                f"{summary['power_w_mean']:.0f} W (highest {summary['power_w_max']:.0f}), "
                f"power-capped {100 * summary['power_capped_share']:.0f} % of {summary['samples']} samples")


def ember_config(cfg: dict):
    """Ember's :class:`~ember.core.config.ModelConfig` of an HF-config shape dict."""
    from ember.core.config import config_from_hf

    return config_from_hf(cfg)


def token_vocab(cfg: dict) -> int:
    """Token ids a request may use (Inkling-2 pads its embedding rows beyond the real vocabulary)."""
    return ember_config(cfg).vocab_size


def random_ember_model(cfg: dict, device: str, dtype: torch.dtype, seed: int = 0, parallelize=None):
    """Ember's ``random_model`` of shape ``cfg`` (std 0.02, norms at identity; the parameters a family
    keeps in fp32 stay fp32), with the parameters created in ``dtype`` from the start: materialised
    in the default fp32 first, the largest shapes (inkling2-small-3l) would need twice their memory."""
    from ember.core.loading import random_model

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return random_model(ember_config(cfg), device, dtype, seed=seed, parallelize=parallelize)
    finally:
        torch.set_default_dtype(previous)


@functools.cache
def _meta_model(key: str):
    from ember.core.loading import build_empty

    return build_empty(ember_config(json.loads(key)))


def _matmul_weights(model) -> list[tuple[torch.nn.Parameter, float]]:
    """``(weight, share)`` for every matmul weight of ``model``: every parameter but 1-D ones and
    embedding lookups (the token embedding, n-gram tables), the LM head included; ``share`` is the
    fraction of tokens that pass through it (routed experts ``top_k / num_experts``, else 1)."""
    from ember.core.layers.moe import Experts

    top_k = int(model.config.raw.get("num_experts_per_tok") or 1)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lookups.discard(id(model.lm_head.weight))  # a tied head is a matmul
    share = {
        id(p): top_k / m.num_experts for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)
    }
    return [(p, share.get(id(p), 1.0)) for p in model.parameters() if p.dim() >= 2 and id(p) not in lookups]


def active_params(cfg: dict) -> float:
    """Matmul parameters a token passes through (:func:`_matmul_weights` of Ember's build of the
    shape on the meta device, each weighted by its share)."""
    return sum(p.numel() * share for p, share in _matmul_weights(_meta_model(json.dumps(cfg, sort_keys=True))))


def decode_roofline_s(model, rows: int, floor_bytes: float) -> float:
    """The roofline of a decode step of ``rows`` tokens that reads ``floor_bytes`` (weights, LoRA
    factors, KV cache): each matmul weight's bytes at the copy bandwidth or its products' FLOPs
    (``2 · rows · share · numel``) at the bf16 matmul peak, whichever takes longer, plus the other
    bytes at the copy bandwidth. Above ``PEAK_BF16_FLOPS / copy_bandwidth()`` rows a token (184 on
    the H200, 263 on the H100; routed experts scaled by their share) a product is bound by the
    tensor cores, not by its weight's bytes, which the bandwidth floor alone leaves out."""
    bw = copy_bandwidth()
    products = bytes_ = 0.0
    for p, share in _matmul_weights(model):
        b = p.numel() * p.element_size()
        products += max(b / bw, 2 * rows * share * p.numel() / PEAK_BF16_FLOPS)
        bytes_ += b
    return products + (floor_bytes - bytes_) / bw


def attention_layers(cfg: dict) -> list[tuple[int, int, int, int | None]]:
    """``(query heads, q·k head dim, v head dim, window)`` of each softmax-attention layer (window
    ``None``: full causal). Gated DeltaNet layers have none; a QSA layer counts as a window of its
    token budget; MLA as its per-head ``d_nope + d_rope`` / ``d_v``."""
    c = ember_config(cfg)
    raw, family = c.raw, c.model_type
    if family in ("deepseek_v3", "glm4_moe_lite"):
        dqk = int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])
        return [(c.num_heads, dqk, int(raw["v_head_dim"]), None)] * c.num_layers
    if family in ("inkling2", "inkling2_text"):
        from ember.core.models.inkling2 import Inkling2Dims

        d = Inkling2Dims.from_config(c)
        full, local = (d.heads, d.head_dim, d.head_dim, None), (d.swa_heads, d.swa_head_dim, d.swa_head_dim, d.window)
        return [full if t == "hybrid" else local for t in d.layer_types]
    if family in ("qwen3_next", "qwen4_exp", "qwen4_exp_text"):
        from ember.core.models.qwen3_next import layer_types

        budget = raw.get("indexer_budget") if raw.get("indexer_n_heads") is not None else None
        kinds = layer_types(c, "full_attention")
        return [(c.num_heads, c.head_dim, c.head_dim, budget) for k in kinds if k == "attention"]
    if family == "olmo3":
        from ember.core.models.olmo3 import layer_types

        window = raw.get("sliding_window", 4096)
        return [(c.num_heads, c.head_dim, c.head_dim, window if t == "sliding_attention" else None) for t in layer_types(c)]
    specs = [c.attention_spec(i) for i in range(c.num_layers)]
    return [(c.num_heads, c.head_dim, c.head_dim, s.window if s.kind == "sliding" else None) for s in specs]


def causal_pairs(s: int, window: int | None) -> float:
    """(query, key) pairs of causal attention over ``s`` tokens, keys within ``window`` (≈ s²/2 full)."""
    if window is None or window >= s:
        return s * s / 2
    return s * window - window * window / 2


def train_flops(cfg: dict, seq_lens: list[int]) -> float:
    """LoRA step FLOPs: 4·N·T (forward + activation gradients; frozen base has no weight gradients)
    plus softmax attention, forward 2·pairs·H·(d_qk + d_v) (2·S²·H·D for full causal attention),
    backward twice that. Approximate for the newer families: linear-attention state updates, relative
    position biases and the QSA indexer's scoring are not counted."""
    tokens = sum(seq_lens)
    attn = sum(
        3 * 2 * causal_pairs(s, window) * heads * (dqk + dv)
        for heads, dqk, dv, window in attention_layers(cfg)
        for s in seq_lens
    )
    return 4 * active_params(cfg) * tokens + attn


def full_train_flops(cfg: dict, seq_lens: list[int]) -> float:
    """Full fine-tuning step FLOPs: :func:`train_flops` plus the weight gradients, 2·N·T (6·N·T in all)."""
    return train_flops(cfg, seq_lens) + 2 * active_params(cfg) * sum(seq_lens)


# ---------------------------------------------------------------------------------------------
# The transformers + PEFT baseline, over the Ember model's weights (same tensors, not copies).
# ---------------------------------------------------------------------------------------------


def hf_baseline_unavailable(cfg: dict) -> str | None:
    """Why transformers + PEFT cannot run this shape here (``None`` if they can): Ember's reference
    version is transformers 5.23; an older one (e.g. 5.17 on the GPU machine's image) may not know
    the newer families (``qwen4_exp``, ``inkling2``)."""
    try:
        import peft  # noqa: F401
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError as e:
        return f"transformers / peft not importable ({e})"
    if cfg["model_type"] not in CONFIG_MAPPING:
        return (
            f"transformers {transformers.__version__} has no model_type {cfg['model_type']!r} "
            "(Ember's parity reference is transformers 5.23)"
        )
    return None


def hf_model_like(model, cfg: dict, dtype: torch.dtype, device: str, experts_implementation: str | None = None):
    """transformers' causal LM of shape ``cfg`` running on ``model``'s weights: built on the meta
    device, each parameter rebound to the Ember tensor of the same name (nothing is copied), router
    correction biases taken from Ember, every other buffer (rotary tables, n-gram hash constants)
    set by the family's own ``_init_weights``. SDPA attention where the family has it, else eager."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**cfg)
    attempts = [{"attn_implementation": "sdpa"}, {"attn_implementation": "eager"}]
    if experts_implementation:
        attempts.insert(0, {"attn_implementation": "sdpa", "experts_implementation": experts_implementation})
    errors = []
    for kwargs in attempts:
        try:
            with torch.device("meta"):
                hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **kwargs)
            break
        except Exception as e:  # noqa: BLE001 - try the next implementation, report all if none works
            errors.append(f"{kwargs}: {type(e).__name__}: {str(e)[:160]}")
    else:
        raise RuntimeError("transformers could not build the model: " + "; ".join(errors))
    if errors:
        print(f"hf: built with {kwargs} ({'; '.join(errors)})", flush=True)
    ours = dict(model.named_parameters(remove_duplicate=False))
    ours.update(model.named_buffers(remove_duplicate=False))
    modules = list(hf.named_modules())
    # buffers Ember has not: allocate and let the family initialise them, before any parameter is
    # rebound (a module's _init_weights also re-initialises its parameters: still meta tensors here)
    to_init = []
    for prefix, mod in modules:
        fresh = False
        for n, b in list(mod._buffers.items()):
            if b is not None and f"{prefix}.{n}".lstrip(".") not in ours:
                mod._buffers[n] = torch.empty_like(b, device=device)
                fresh = True
        if fresh:
            to_init.append(mod)
    with torch.no_grad():
        for mod in to_init:
            hf._init_weights(mod)
    missing = []
    for prefix, mod in modules:
        for kind in ("_parameters", "_buffers"):
            table = getattr(mod, kind)
            for n, t in list(table.items()):
                name = f"{prefix}.{n}".lstrip(".")
                if t is None or (kind == "_buffers" and name not in ours):
                    continue
                src = ours.get(name)
                if src is None or src.shape != t.shape:
                    missing.append(f"{name} {tuple(t.shape)} (Ember: {None if src is None else tuple(src.shape)})")
                    continue
                src = src.detach().to(device)  # (a host-resident table, qwen4_exp's n-grams: HF keeps it on the device)
                table[n] = torch.nn.Parameter(src, requires_grad=False) if kind == "_parameters" else src.to(t.dtype)
    if missing:
        raise ValueError(f"transformers' weights do not match Ember's: {', '.join(missing[:5])}")
    return hf


def peft_targets(model, categories=("attn", "mlp")) -> tuple[list[str], list[str]]:
    """PEFT ``target_modules`` and ``target_parameters`` adapting the same weights as an Ember
    adapter of ``categories`` (Ember's LoRA names are the transformers module paths)."""
    modules, params = set(), set()
    for t in model.lora_targets():
        if t.category not in categories:
            continue
        if t.num_experts:
            params.add(t.name.split(".layers.", 1)[-1].split(".", 1)[-1])  # mlp.experts.gate_up_proj
        else:
            modules.add(t.name.rsplit(".", 1)[-1])
    # stacked experts: gate_up_proj first (PEFT wraps the first target_parameter innermost)
    return sorted(modules), sorted(params, key=lambda p: (not p.endswith("gate_up_proj"), p))


@contextlib.contextmanager
def _peft_keeps_mlp_targets(active: bool):
    """PEFT (with transformers 5) rewrites ``gate_proj``/``up_proj``/``down_proj`` targets of an MoE
    model type onto the fused experts (its transformers-4 checkpoint conversion), which would strip
    the dense-layer and shared-expert MLPs of their adapters; switch that off while the PEFT model is
    built, as the parity tests do."""
    conv = None
    if active:
        try:
            import peft.utils.transformers_weight_conversion as conv
        except ImportError:
            conv = None
    original = getattr(conv, "convert_peft_config_for_transformers", None)
    if original is None:
        yield
        return
    conv.convert_peft_config_for_transformers = lambda *a, **k: None
    try:
        yield
    finally:
        conv.convert_peft_config_for_transformers = original


def peft_model_like(hf, model, rank: int, alpha: float = 32.0):
    """PEFT LoRA (rank ``rank``, dropout 0) over ``hf`` on the weights an Ember ``attn``+``mlp``
    adapter of ``model`` adapts."""
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    modules, params = peft_targets(model)
    peft_cfg = PeftConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules, target_parameters=params or None
    )
    moe_mlp = bool(params) and bool({"gate_proj", "up_proj", "down_proj"} & set(modules))
    with _peft_keeps_mlp_targets(moe_mlp):
        return get_peft_model(hf, peft_cfg)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def event_time_ms(fn, warmup: int, reps: int) -> float:
    """Mean GPU time of ``fn`` in ms over ``reps`` calls (CUDA events), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sync_points(fn: Callable[[], object]) -> list[tuple[str, int]]:
    """Where ``fn()`` makes the host wait for the GPU: run under ``torch.cuda.set_sync_debug_mode``,
    each synchronising call counted by the innermost line of Ember's code (or the bench's) on its
    Python stack, most frequent first. A wait drains the GPU's queue, which then idles while the
    host launches what follows."""
    import traceback
    import warnings
    from collections import Counter

    import ember

    repo = Path(ember.__file__).parent.parent
    roots = (str(repo / "ember"), str(repo / "bench"))
    counts: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(roots)]
        where = ours[-1] if ours else None
        place = f"{Path(where.filename).relative_to(repo)}:{where.lineno} {where.name}" if where else f"{filename}:{lineno}"
        counts[place] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return counts.most_common()


def graph_us(fns: list[Callable[[], object]], iters: int = 20) -> float:
    """GPU microseconds per call of the callables ``fns`` (called in turn, e.g. one product over
    several weight copies, so none is read from L2), captured in one CUDA graph after three warm-up
    calls on a side stream and replayed ``iters`` times between CUDA events: no host launch
    overhead, as in a decode step."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns[:3] if len(fns) >= 3 else fns * 3:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * len(fns))


def compile_seconds() -> dict[str, float]:
    """Seconds this process has spent in ``torch.compile`` so far, from Dynamo's own metrics:
    ``total`` (tracing and the backend) and ``backend`` (Inductor's code generation and
    autotuning); empty when nothing was compiled. What a first step spends beyond them is
    other first-use work (Triton autotuning outside Inductor, e.g. fla's; cuBLAS handles)."""
    from torch._dynamo.utils import compile_times

    rows = dict(line.rsplit(", ", 1) for line in compile_times(repr="str", aggregate=True).splitlines()[2:]
                if ", " in line)
    out = {"total": rows.get("_compile.compile_inner"), "backend": rows.get("OutputGraph.call_user_compiler")}
    return {k: float(v) for k, v in out.items() if v is not None}


def time_steps(fn: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Wall times (s) of ``iters`` calls of ``fn`` after ``warmup`` calls, synchronised; prints each
    call's time as it ends (a first call's compilation shows there)."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        label = f"warm-up {i + 1}/{warmup}" if i < warmup else f"step {i - warmup + 1}/{iters}"
        print(f"    {label}: {times[-1]:.3f} s", flush=True)
    return times[warmup:]


class MemoryMeter:
    """Static and peak allocated device memory around a region (zeros on the CPU)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.static = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.static = 0

    def stop(self) -> dict[str, float]:
        peak = torch.cuda.max_memory_allocated() if self.cuda else 0
        return {"peak_gib": gib(peak), "static_gib": gib(self.static), "activation_gib": gib(peak - self.static)}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def _rank_entry(rank: int, world: int, init: str, results, target, args) -> None:
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        out = target(rank, world, *args)
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def run_ranks(nproc: int, target: Callable, *args) -> dict:
    """``target(rank, world, *args)`` on ``nproc`` spawned processes joined in a process group (one
    GPU each, NCCL; gloo on the CPU); returns rank 0's result (a dict), or an error."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_entry, args=(r, nproc, f"file://{tmp}/pg", results, target, args))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    if any(p.exitcode for p in procs):
        return {"error": f"ranks exited with {[p.exitcode for p in procs]}"}
    return results.get()


def run_cases(description: str, name: str, case: Callable[..., dict], layers: int,
              default: str = "64:1:32,256:8:32", flags: dict[str, str] | None = None) -> None:
    """The command line of a decode-kernel bench: ``--cases rows:busy adapters:rank,...`` (default:
    workloads a and b), ``--out`` (a folder for ``<name>.json``) and the bench's own ``flags`` (name:
    help; each passed to ``case`` as a keyword, true when given). Runs ``case(rows, busy, rank)``
    for each and prints its entries, µs a step of ``layers`` layers (an entry may be a dict of them)."""
    import argparse

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=default, help="rows:busy adapters:rank, comma separated")
    ap.add_argument("--out", type=Path, default=None, help=f"folder for {name}.json")
    for flag, text in (flags or {}).items():
        ap.add_argument("--" + flag.replace("_", "-"), action="store_true", help=text)
    args = ap.parse_args()
    chosen = {flag: getattr(args, flag) for flag in flags or {}}
    print(f"hardware: {hardware_line()}; torch {torch.__version__}", flush=True)
    results = {}
    for spec in args.cases.split(","):
        rows, busy, rank = (int(v) for v in spec.split(":"))
        r = case(rows, busy, rank, **chosen)
        results[spec] = r
        print(f"{rows} rows, {busy} adapters of rank {rank} (µs a step, {layers} layers):")
        for key, us in r.items():
            shown = ", ".join(f"{k} {v:.0f}" for k, v in us.items()) if isinstance(us, dict) else f"{us:.0f}"
            print(f"  {key:50s} {shown}", flush=True)
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps({"hardware": hardware_line(), "results": results},
                                                          indent=1))
