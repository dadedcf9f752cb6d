"""Causal attention over packed documents.

A packed batch concatenates documents without padding; attention must stay inside each document
(``cu_seqlens`` marks their boundaries). On CUDA we use variable-length flash attention
(``torch.nn.attention.varlen``); elsewhere a loop of ``scaled_dot_product_attention`` over the
documents, which is exact and cheap at test sizes.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F

from ember.core.batch import to_device
from ember.core.config import AttentionSpec
from ember.core.layers.rope import qk_norms


@cache
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


_NATIVE_GQA: dict[str, bool] = {}


def _sliding_mask(n: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def sdpa_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, scale: float
) -> torch.Tensor:
    """Causal attention for one document: q ``[n, Hq, D]``, k/v ``[n, Hkv, D]`` -> ``[n, Hq, Dv]``."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if rep > 1:
        kh = kh.repeat_interleave(rep, dim=0)
        vh = vh.repeat_interleave(rep, dim=0)
    if spec.kind == "sliding" and spec.window is not None and spec.window < q.shape[0]:
        mask = _sliding_mask(q.shape[0], spec.window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return out.transpose(0, 1)


class PackedAttention:
    """Attention for a packed batch of documents, all starting at position 0 (training, scoring)."""

    def __init__(self, doc_lengths: list[int], device: torch.device, backend: str | None = None):
        self.doc_lengths = list(doc_lengths)
        self.max_seqlen = max(self.doc_lengths) if self.doc_lengths else 0
        lengths = torch.tensor([0] + self.doc_lengths, dtype=torch.int32)
        self.cu_seqlens = to_device(torch.cumsum(lengths, 0, dtype=torch.int32), device)
        self.backend = backend or ("varlen" if device.type == "cuda" and _varlen_fn()[0] else "sdpa")

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, scale: float
    ) -> torch.Tensor:
        if self.backend == "varlen" and q.dtype in (torch.bfloat16, torch.float16):
            return self._varlen(q, k, v, spec, scale)
        outs, start = [], 0
        for n in self.doc_lengths:
            outs.append(sdpa_document(q[start : start + n], k[start : start + n], v[start : start + n], spec, scale))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _varlen(self, q, k, v, spec: AttentionSpec, scale: float) -> torch.Tensor:
        dv = v.shape[-1]
        if dv != q.shape[-1]:
            # flash attention wants one head size for q, k and v; MLA's values are narrower (128 vs
            # 192): pad them with zeros (the padded output columns are zeros) and drop those columns
            return self._varlen(q, k, F.pad(v, (0, q.shape[-1] - dv)), spec, scale)[..., :dv]
        fn, params = _varlen_fn()
        kwargs = {"scale": scale}
        window = spec.window if spec.kind == "sliding" else None
        if "window_size" in params:
            kwargs["window_size"] = (window - 1, 0) if window else (-1, 0)
        else:
            if window:
                raise NotImplementedError("this torch's varlen_attn has no sliding window")
            kwargs["is_causal"] = True
        cu = self.cu_seqlens
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            elif _NATIVE_GQA.get("ok", True):
                # flash attention takes fewer KV heads natively; older wrappers may refuse
                try:
                    out = fn(q, k, v, cu, cu, self.max_seqlen, self.max_seqlen, **kwargs)
                    _NATIVE_GQA["ok"] = True
                    return out
                except RuntimeError:
                    _NATIVE_GQA["ok"] = False
            if "enable_gqa" not in kwargs:
                rep = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
        return fn(q, k, v, cu, cu, self.max_seqlen, self.max_seqlen, **kwargs)


def decode_qkv_attention(attn, x: torch.Tensor, ctx, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """A decode step's attention straight from the layer's packed q/k/v product, where the context
    offers both halves: the LoRA route's ``qkv_product`` (the static decoder's
    :class:`~ember.core.sampling.static_route.StaticRoute`: the packed product, its LoRA delta not
    yet added) and the attention's ``attend_qkv`` (:class:`~ember.core.sampling.attention.DecodeAttention`
    on the Triton path: one kernel adds the delta, normalises and rotates the queries and keys and
    stores the keys and values in the cache, :mod:`ember.core.kernels.qkv_decode`). ``None``
    elsewhere, and the layer projects, rotates and attends as usual.

    ``attn``: a layer with ``q_proj``, ``k_proj``, ``v_proj``, ``q_norm`` and ``k_norm`` (RMSNorms
    or None), ``head_dim``, ``layer``, ``spec`` and ``scale`` (:class:`ember.core.models.llama.Attention`)."""
    product = getattr(ctx.lora, "qkv_product", None)
    takes = getattr(ctx.attend, "takes_qkv", None)
    if product is None or takes is None or torch.is_grad_enabled() or x.dim() != 2 or not takes(x):
        return None
    norms = qk_norms(attn.q_norm, attn.k_norm, x.dtype)
    d = attn.head_dim
    q_out, k_out = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    if norms is False or attn.v_proj.weight.shape[0] != k_out or q_out % d or k_out % d or cos.shape[-1] > d:
        return None
    got = product(attn.q_proj, x)
    if got is None:
        return None
    y, lora = got
    return ctx.attend.attend_qkv(attn.layer, y, (q_out // d, k_out // d), cos, sin, norms, lora, attn.spec, attn.scale)
