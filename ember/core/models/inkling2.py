"""Inkling-2 (transformers ``inkling2`` / ``inkling2_text``, the text model; spec §2).

A decoder of attention + MoE layers without RoPE: positions enter only through a learned
relative-position bias and short convolutions. Per layer (transformers ``Inkling2*DecoderLayer``)::

    a = mix_attn(bank, partial)                  block attention residual (§2.2); layer 0: partial
    y = sconv_out( attention( norm(a) ) )         sliding-window or global (config ``layer_types``)
    partial' = y            if the layer opens a block (bank += partial)   else  partial + y
    m = mix_mlp(bank, partial')
    partial'' = partial' + sconv_mlp( moe( norm(m) ) )

and the output is ``norm(mix_final(bank, partial))``. Attention (``Inkling2SlidingAttention`` /
``Inkling2FullAttention``)::

    q = l2clip(s_q ⊙ Wq x)   k = l2clip(sconv_k(Wk x))   v = rms(sconv_v(Wv x))   r = l2clip(s_r ⊙ Wr x)
    global layers: q, r *= 1 + α·log(max((pos+1)/n_floor, 1));  their K/V convolutions have
                   per-token taps and their q, k, v read three separate mixtures
    out = o_proj( σ(W_gate x) ⊙ attn(q, k, v; bias = r @ P by distance, sink = W_sink x) )

The MoE routes with sigmoid scores whose correction bias only selects experts; experts use the
softcapped SiTU-GLU; the LM head's logits are softcapped (30) and only its first
``unpadded_vocab_size`` rows are tokens.

LoRA targets: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and the output gate ``gate_proj``
(attn), the routed experts (mlp), the LM head (unembed). Frozen: router and its bias, norms,
convolutions (and their tap projections), the relative-state projection ``r_proj`` and profile bank,
the sink projection, L2-clip scales and the attention-residual queries.

Checkpoints are read in the released layout (``model.llm.*``, interleaved ``w13`` experts), which is
also what ``save_pretrained`` writes: :meth:`Inkling2ForCausalLM.map_checkpoint_key` renames them to
the transformers module names used here (and in LoRA/PEFT names).

Attention runs through :class:`~ember.core.layers.relative_attention.PackedRelativeAttention` over
``ctx.seq_lens`` in training and scoring (exact eager on CPU, FlexAttention on CUDA). A sampling
pass (``ctx.state`` set: prefill or decode) must bring a KV cache that applies the bias and sinks:
``ctx.attend.relative(layer, q, k, v, profiles, sinks, spec, scale)`` (it can call
:func:`~ember.core.layers.relative_attention.relative_attention_dense` on the cached keys and their
positions); the short-convolution windows travel in ``ctx.state``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.config import ModelConfig
from ember.core.layers.activations import sigmoid_gate
from ember.core.layers.attn_residuals import BlockAttentionResidual, ResidualBank
from ember.core.layers.capped_glu import CappedGLUExperts
from ember.core.layers.lora import LoraLinear, LoraRoute
from ember.core.layers.moe import RoutingRecord, route
from ember.core.layers.norms import RMSNorm
from ember.core.layers.relative_attention import PackedRelativeAttention, RelativeAttentionSpec
from ember.core.layers.router import GroupLimitedSigmoidRouter
from ember.core.layers.short_conv import DynamicShortConvolution, ShortConvolution
from ember.core.models.base import CausalLM, ForwardContext, set_padding_idx

SLIDING, GLOBAL = "hybrid_sliding", "hybrid"


@dataclass(frozen=True)
class Inkling2Dims:
    """The architecture fields of an Inkling-2 text config (``Inkling2TextConfig``; its defaults)."""

    hidden: int
    vocab: int
    unpadded_vocab: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    swa_heads: int
    swa_kv_heads: int
    swa_head_dim: int
    window: int
    d_rel: int
    rel_extent: int
    log_n_floor: int
    log_alpha: float
    eps: float
    kernel: int
    moe_intermediate: int
    num_experts: int
    top_k: int
    route_scale: float
    qk_clip: float
    rel_clip: float
    layers_per_block: int
    gate_cap: float
    up_cap: float
    final_softcap: float

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Inkling2Dims:
        raw = cfg.raw

        def get(*names, default):
            for n in names:
                if raw.get(n) is not None:
                    return raw[n]
            return default

        n_layers = int(get("num_hidden_layers", default=cfg.num_layers))
        types = raw.get("layer_types")
        if types is None and raw.get("local_layer_ids") is not None:
            local = {int(i) for i in raw["local_layer_ids"]}
            types = [SLIDING if i in local else GLOBAL for i in range(n_layers)]
        if types is None:
            types = [GLOBAL if (i + 1) % 6 == 0 else SLIDING for i in range(n_layers)]
        types = tuple(types[:n_layers])
        bad = sorted(set(types) - {SLIDING, GLOBAL})
        if bad or len(types) != n_layers:
            raise ValueError(f"inkling2 layer_types must list {n_layers} of {SLIDING!r}/{GLOBAL!r}, got {bad or types}")
        scoring = get("scoring_func", default="sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"inkling2 scoring_func {scoring!r} is not supported (only 'sigmoid')")
        vocab = int(get("vocab_size", default=cfg.vocab_size))
        return cls(
            hidden=int(get("hidden_size", default=cfg.hidden_size)),
            vocab=vocab,
            unpadded_vocab=int(get("unpadded_vocab_size", default=vocab)),
            layer_types=types,
            heads=int(get("num_attention_heads", default=48)),
            kv_heads=int(get("num_key_value_heads", default=8)),
            head_dim=int(get("head_dim", default=128)),
            swa_heads=int(get("swa_num_attention_heads", default=48)),
            swa_kv_heads=int(get("swa_num_key_value_heads", default=8)),
            swa_head_dim=int(get("swa_head_dim", default=128)),
            window=int(get("sliding_window_size", "sliding_window", default=1024)),
            d_rel=int(get("d_rel", default=16)),
            rel_extent=int(get("rel_extent", default=1024)),
            log_n_floor=int(get("log_scaling_n_floor", default=128000)),
            log_alpha=float(get("log_scaling_alpha", default=0.1)),
            eps=float(get("rms_norm_eps", default=1e-6)),
            kernel=int(get("conv_kernel_size", "sconv_kernel_size", default=4)),
            moe_intermediate=int(get("moe_intermediate_size", "intermediate_size", default=2304)),
            num_experts=int(get("n_routed_experts", "num_local_experts", default=384)),
            top_k=int(get("num_experts_per_tok", default=8)),
            route_scale=float(get("route_scale", "routed_scaling_factor", default=8.0)),
            qk_clip=float(get("qk_l2_clip_threshold", default=22.627416997969522)),
            rel_clip=float(get("rel_l2_clip_threshold", default=8.0)),
            layers_per_block=int(get("n_layers_per_attn_res_block", default=6)),
            gate_cap=float(get("mlp_gate_softcap", default=4.0)),
            up_cap=float(get("mlp_up_softcap", default=25.0)),
            final_softcap=float(get("final_logit_softcapping", default=30.0)),
        )


def l2_clip(x: torch.Tensor, threshold: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scale each head vector (last dim) down to L2 norm ``threshold`` if longer, after an optional
    per-channel ``scale`` (fp32; transformers ``Inkling2L2Clip`` / ``Inkling2ScaledL2Clip``)."""
    xf = x.float()
    if scale is not None:
        xf = xf * scale.float()
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    return (xf * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


class ScaledL2Clip(nn.Module):
    """L2 clipping after a learned per-head, per-channel scale (``scale`` ``[heads, dim]``)."""

    def __init__(self, heads: int, dim: int, threshold: float):
        super().__init__()
        self.threshold = threshold
        self.scale = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_clip(x, self.threshold, self.scale)


class RelativeLogits(nn.Module):
    """The bank of bias-vs-distance profiles ``proj`` ``[d_rel, R]``: a token's relative state
    ``[heads, d_rel]`` times it is that token's bias at each backward distance ``< R``."""

    def __init__(self, d_rel: int, rel_extent: int):
        super().__init__()
        self.proj = nn.Parameter(torch.empty(d_rel, rel_extent))

    def forward(self, relative_states: torch.Tensor) -> torch.Tensor:
        return relative_states @ self.proj


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm in fp32 (transformers ``Inkling2UnweightedRMSNorm`` on a float input)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


RelativeAttendFn = Callable[..., torch.Tensor]


@dataclass
class _Pass:
    """What every layer of one forward pass shares."""

    ctx: ForwardContext
    seq_lens: list[int]
    attend: RelativeAttendFn  # (layer, q, k, v, profiles, sinks, spec, scale) -> out
    log_scale: torch.Tensor  # [T, 1, 1] fp32 log-position scaling of the global layers


class Inkling2Attention(nn.Module):
    """Sliding-window or global attention with relative bias, sinks, L2 clipping, K/V short
    convolutions and an output gate."""

    def __init__(self, dims: Inkling2Dims, layer: int):
        super().__init__()
        self.layer = layer
        self.is_global = dims.layer_types[layer] == GLOBAL
        self.separate_inputs = self.is_global  # q, k and v read three mixtures (not one packed GEMM)
        g = self.is_global
        h = dims.hidden
        self.heads = dims.heads if g else dims.swa_heads
        self.kv_heads = dims.kv_heads if g else dims.swa_kv_heads
        self.head_dim = dims.head_dim if g else dims.swa_head_dim
        self.eps = dims.eps
        self.qk_clip = dims.qk_clip
        self.scale = self.head_dim**-0.5
        self.spec = RelativeAttentionSpec(
            window=None if g else dims.window, rel_extent=dims.rel_extent if g else dims.window
        )
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = LoraLinear(h, q_dim, False, "attn")
        self.k_proj = LoraLinear(h, kv_dim, False, "attn")
        self.v_proj = LoraLinear(h, kv_dim, False, "attn")
        self.r_proj = nn.Linear(h, self.heads * dims.d_rel, bias=False)
        self.o_proj = LoraLinear(q_dim, h, False, "attn")
        if g:
            self.k_sconv = DynamicShortConvolution(kv_dim, h, self.kv_heads, dims.kernel, layer, "k_conv")
            self.v_sconv = DynamicShortConvolution(kv_dim, h, self.kv_heads, dims.kernel, layer, "v_conv")
        else:
            self.k_sconv = ShortConvolution(kv_dim, dims.kernel, layer, "k_conv")
            self.v_sconv = ShortConvolution(kv_dim, dims.kernel, layer, "v_conv")
        self.rel_logits_proj = RelativeLogits(dims.d_rel, self.spec.rel_extent)
        self.gate_proj = LoraLinear(h, q_dim, False, "attn")
        self.sink_proj = nn.Linear(h, self.heads, bias=False)
        self.q_l2_clip = ScaledL2Clip(self.heads, self.head_dim, dims.qk_clip)
        self.rel_l2_clip = ScaledL2Clip(self.heads, dims.d_rel, dims.rel_clip)

    def forward(self, x: torch.Tensor, run: _Pass, k_in: torch.Tensor | None = None, v_in: torch.Tensor | None = None):
        T, d = x.shape[0], self.head_dim
        lora, state = run.ctx.lora, run.ctx.state
        k_in = x if k_in is None else k_in
        v_in = x if v_in is None else v_in
        q = self.q_proj(x, lora)
        if self.is_global:
            k = self.k_sconv(self.k_proj(k_in, lora), k_in, run.seq_lens, state)
            v = self.v_sconv(self.v_proj(v_in, lora), v_in, run.seq_lens, state)
        else:
            k = self.k_sconv(self.k_proj(k_in, lora), run.seq_lens, state)
            v = self.v_sconv(self.v_proj(v_in, lora), run.seq_lens, state)
        r = self.r_proj(x)
        gate = self.gate_proj(x, lora)
        sinks = self.sink_proj(x)

        q = self.q_l2_clip(q.view(T, self.heads, d))
        k = l2_clip(k.view(T, self.kv_heads, d), self.qk_clip)
        v = _unit_rms(v.view(T, self.kv_heads, d).float(), self.eps).to(v.dtype)
        r = self.rel_l2_clip(r.view(T, self.heads, -1))
        if self.is_global:
            q = (q.float() * run.log_scale).to(q.dtype)
            r = (r.float() * run.log_scale).to(r.dtype)
        profiles = self.rel_logits_proj(r)  # [T, heads, R]
        o = run.attend(self.layer, q, k, v, profiles, sinks, self.spec, self.scale).reshape(T, -1)
        o = sigmoid_gate(o, gate, wide=True)
        return self.o_proj(o, lora)


class Inkling2MoE(nn.Module):
    """Sigmoid router (selection-only bias) over softcapped SiTU-GLU experts."""

    def __init__(self, dims: Inkling2Dims, layer: int):
        super().__init__()
        self.layer = layer
        self.experts = CappedGLUExperts(
            dims.hidden, dims.moe_intermediate, dims.num_experts, dims.gate_cap, dims.up_cap
        )
        # one group of all experts: plain top-k of σ(z) + bias, weights renormalised × route_scale
        self.gate = GroupLimitedSigmoidRouter(
            dims.hidden, dims.num_experts, dims.top_k, routed_scaling_factor=dims.route_scale
        )

    def forward(self, x: torch.Tensor, lora: LoraRoute | None, routing: RoutingRecord | None) -> torch.Tensor:
        r = route(self.layer, self.gate, x, routing)
        return self.experts(x, r, lora)


class Inkling2DecoderLayer(nn.Module):
    """Attention and MoE sublayers, each reading a block attention residual mixture."""

    def __init__(self, dims: Inkling2Dims, layer: int):
        super().__init__()
        h, eps = dims.hidden, dims.eps
        self.is_global = dims.layer_types[layer] == GLOBAL
        self.is_block_boundary = layer % dims.layers_per_block == 0
        self.attention_input = BlockAttentionResidual(h, 3 if self.is_global else 1) if layer > 0 else None
        self.mlp_input = BlockAttentionResidual(h)
        self.self_attn = Inkling2Attention(dims, layer)
        self.mlp = Inkling2MoE(dims, layer)
        if self.is_global:
            self.q_input_layernorm = RMSNorm(h, eps)
            self.k_input_layernorm = RMSNorm(h, eps)
            self.v_input_layernorm = RMSNorm(h, eps)
        else:
            self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_convolution = ShortConvolution(h, dims.kernel, layer, "attn_out")
        self.post_mlp_convolution = ShortConvolution(h, dims.kernel, layer, "mlp_out")

    def forward(self, partial: torch.Tensor, bank: ResidualBank, run: _Pass) -> torch.Tensor:
        """The next partial block; closes ``partial`` into ``bank`` when this layer opens a block."""
        dtype = partial.dtype
        ctx = run.ctx
        n = 3 if self.is_global else 1
        mixes = (partial,) * n if self.attention_input is None else self.attention_input(bank, partial)
        if self.is_global:
            a = self.self_attn(
                self.q_input_layernorm(mixes[0]).to(dtype),
                run,
                k_in=self.k_input_layernorm(mixes[1]).to(dtype),
                v_in=self.v_input_layernorm(mixes[2]).to(dtype),
            )
        else:
            a = self.self_attn(self.input_layernorm(mixes[0]).to(dtype), run)
        a = self.post_attention_convolution(a, run.seq_lens, ctx.state)
        residual = a.float()
        if self.is_block_boundary:
            bank.append(partial)
        else:
            residual = partial.float() + residual
        m = self.mlp_input(bank, residual)[0]
        y = self.mlp(self.post_attention_layernorm(m).to(dtype), ctx.lora, ctx.routing)
        y = self.post_mlp_convolution(y, run.seq_lens, ctx.state)
        return (residual + y).to(dtype)


class NormedEmbedding(nn.Module):
    """Token embedding followed by an RMSNorm (transformers ``Inkling2NormedEmbedding``)."""

    padding_idx: int | None = None  # the row that gets no gradient (set by CausalLM.attach)

    def __init__(self, vocab: int, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))
        self.embed_norm = RMSNorm(hidden, eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(F.embedding(ids, self.weight, self.padding_idx))


class Inkling2Decoder(nn.Module):
    """Embedding, decoder layers, final mixture and norm (transformers ``Inkling2TextModel``)."""

    def __init__(self, dims: Inkling2Dims):
        super().__init__()
        self.embed_tokens = NormedEmbedding(dims.vocab, dims.hidden, dims.eps)
        self.layers = nn.ModuleList(Inkling2DecoderLayer(dims, i) for i in range(len(dims.layer_types)))
        self.norm = RMSNorm(dims.hidden, dims.eps)
        self.final_input = BlockAttentionResidual(dims.hidden)


class PaddedLMHead(LoraLinear):
    """The LM head ``[vocab_size, H]`` as stored; only its first ``unpadded`` rows are tokens, so
    logits, softmax and the head's LoRA target (``out_features``) cover only those rows."""

    def __init__(self, hidden: int, vocab: int, unpadded: int):
        super().__init__(hidden, vocab, False, "unembed")
        self.out_features = unpadded


class Inkling2ForCausalLM(CausalLM):
    """Inkling-2 text model."""

    # whole prompts only: relative attention runs the trainer's packed call, from position 0
    static_decode = True

    # packed attention backend: None picks FlexAttention on CUDA and the exact eager path elsewhere
    attention_backend: str | None = None

    # kept in fp32 whatever the load dtype, as transformers does (``_keep_in_fp32_modules_strict``)
    fp32_parameters = (
        "e_score_correction_bias",
        "mlp.gate.weight",
        "post_attention_convolution.conv1d.weight",
        "post_mlp_convolution.conv1d.weight",
        "k_sconv.conv1d.weight",
        "v_sconv.conv1d.weight",
        "attention_input.query",
        "mlp_input.query",
        "final_input.query",
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.dims = dims = Inkling2Dims.from_config(cfg)
        if not 0 < dims.unpadded_vocab <= dims.vocab:
            raise ValueError(f"unpadded_vocab_size {dims.unpadded_vocab} must be in 1..vocab_size ({dims.vocab})")
        self.final_logit_softcap = dims.final_softcap
        self.model = Inkling2Decoder(dims)
        set_padding_idx(self.model.embed_tokens, cfg)
        self.lm_head = PaddedLMHead(dims.hidden, dims.vocab, dims.unpadded_vocab)
        for p in self.parameters():
            p.requires_grad_(False)
        self.name_lora_modules()

    @property
    def unembed_weight(self) -> torch.Tensor:
        return self.lm_head.weight[: self.dims.unpadded_vocab]

    def _relative_attend(self, ctx: ForwardContext, seq_lens: list[int]) -> RelativeAttendFn:
        cached = getattr(ctx.attend, "relative", None)
        if cached is not None:
            return cached
        if ctx.state is not None:
            raise ValueError(
                "inkling2: a pass that continues sequences (ctx.state) needs ctx.attend.relative(layer, q, k, v, "
                "profiles, sinks, spec, scale), an attention with a KV cache, relative bias and sinks"
            )
        packed = PackedRelativeAttention(seq_lens, ctx.positions, backend=self.attention_backend)
        return lambda layer, q, k, v, profiles, sinks, spec, scale: packed(q, k, v, profiles, sinks, spec, scale)

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = input_ids.shape[0]
        seq_lens = list(ctx.seq_lens) if ctx.seq_lens is not None else [T]
        if sum(seq_lens) != T:
            raise ValueError(f"ctx.seq_lens sums to {sum(seq_lens)}, but the pass has {T} tokens")
        d = self.dims
        pos = ctx.positions.float()
        log_scale = 1.0 + d.log_alpha * torch.log(((pos + 1.0) / d.log_n_floor).clamp(min=1.0))
        run = _Pass(
            ctx=ctx,
            seq_lens=seq_lens,
            attend=self._relative_attend(ctx, seq_lens),
            log_scale=log_scale[:, None, None],
        )
        x = self.model.embed_tokens(input_ids)
        bank = ResidualBank()
        for layer in self.model.layers:
            x = layer(x, bank, run)
        x = self.model.final_input(bank, x)[0]
        return self.model.norm(x).to(self.model.embed_tokens.weight.dtype)

    # -- checkpoint layout ----------------------------------------------------------------------

    _LAYER_RENAMES = (
        (r"attn\.wq_du\.", "self_attn.q_proj."),
        (r"attn\.wk_dv\.", "self_attn.k_proj."),
        (r"attn\.wv_dv\.", "self_attn.v_proj."),
        (r"attn\.wr_du\.", "self_attn.r_proj."),
        (r"attn\.wo_ud\.", "self_attn.o_proj."),
        (r"attn\.gate_attn\.", "self_attn.gate_proj."),
        (r"attn\.attn_sink_proj\.", "self_attn.sink_proj."),
        (r"attn\.(q_l2_clip|k_l2_clip|rel_l2_clip|rel_logits_proj)\.", r"self_attn.\1."),
        (r"attn\.(k_sconv|v_sconv)\.weight$", r"self_attn.\1.conv1d.weight"),
        (r"attn\.(k_sconv|v_sconv)\.static_w$", r"self_attn.\1.static_weight"),
        (r"attn\.(k_sconv|v_sconv)\.weight_proj$", r"self_attn.\1.weight_proj.weight"),
        (r"attn_sconv\.weight$", "post_attention_convolution.conv1d.weight"),
        (r"mlp_sconv\.weight$", "post_mlp_convolution.conv1d.weight"),
        (r"attn_norm\.", "input_layernorm."),
        (r"mlp_norm\.", "post_attention_layernorm."),
        (r"(q|k|v)_input_norm\.", r"\1_input_layernorm."),
        (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
        (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    )

    @classmethod
    def map_checkpoint_key(cls, key: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor] | None] | None:
        """The parameter a checkpoint tensor fills and how to convert it, or ``None`` to skip it.

        Reads the released layout (``model.llm.*``; what transformers' ``save_pretrained`` writes
        too, reversing its ``inkling2_text`` conversion mapping) and transformers' in-memory names
        (``model.*`` / ``model.language_model.*``). Vision, MTP and other non-text tensors are skipped.
        """
        # MXFP8/NVFP4 weights reach here already dequantized (their ``_scale`` companions are read
        # by the checkpoint reader); other quantization schemes are not supported
        if re.search(r"(_scale_inv|_amax)$", key) and ".experts." in key:
            raise NotImplementedError(f"inkling2: expert tensor {key!r} uses an unsupported quantization scheme")
        if key.startswith("model.llm."):
            body = key[len("model.llm.") :]
        elif key.startswith("model.language_model."):
            return "model." + key[len("model.language_model.") :], None
        elif key == "lm_head.weight" or (
            key.startswith("model.") and not key.startswith(("model.visual.", "model.vision_tower."))
        ):
            return key, None
        else:
            return None
        if body == "unembed.weight":
            return "lm_head.weight", None
        if body == "embed.weight":
            return "model.embed_tokens.weight", None
        if body == "embed_norm.weight":
            return "model.embed_tokens.embed_norm.weight", None
        if body == "norm.weight":
            return "model.norm.weight", None
        if m := re.fullmatch(r"attn_res\.attn_queries\.(\d+)", body):
            return f"model.layers.{int(m[1]) + 1}.attention_input.query", None
        if m := re.fullmatch(r"attn_res\.mlp_queries\.(\d+)", body):
            return f"model.layers.{m[1]}.mlp_input.query", None
        if body == "attn_res.output_query":
            return "model.final_input.query", None
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", body)
        if m is None:
            return None
        prefix, rest = f"model.layers.{m[1]}.", m[2]
        if rest == "mlp.experts.w13_weight":
            return prefix + "mlp.experts.gate_up_proj", deinterleave_gate_up
        for pattern, repl in cls._LAYER_RENAMES:
            new, n = re.subn(pattern, repl, rest)
            if n:
                return prefix + new, None
        return prefix + rest, None


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """Released experts store gate and up rows interleaved (``[g0, u0, g1, u1, …]`` along dim 1);
    transformers (and :class:`~ember.core.layers.moe.Experts`) want ``[gate; up]``."""
    return torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)


__all__ = ["Inkling2Dims", "Inkling2ForCausalLM", "deinterleave_gate_up", "l2_clip"]
