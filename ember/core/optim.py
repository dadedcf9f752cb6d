"""AdamW per adapter, with Tinker's ``AdamParams`` (step-time hyperparameters).

Each adapter owns a ``torch.optim.AdamW`` over its own factors, so one adapter's step never reads or
writes another's weights, gradients or moments. Gradients accumulate across ``forward_backward``
calls until ``step`` (which clips, updates and clears them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamParams:
    """Tinker's ``AdamParams``: ``grad_clip_norm`` 0 disables clipping; weight decay is decoupled."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first out-of-range field."""
        checks = [
            ("learning_rate", self.learning_rate >= 0),
            ("beta1", 0 <= self.beta1 < 1),
            ("beta2", 0 <= self.beta2 < 1),
            ("eps", self.eps >= 0),
            ("weight_decay", self.weight_decay >= 0),
            ("grad_clip_norm", self.grad_clip_norm >= 0),
        ]
        for name, ok in checks:
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise ValueError(f"adam_params.{name}={value} is out of range")


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``tensors`` together, a 0-d tensor of their dtype on their device. On CUDA
    ``torch.nn.utils.get_total_norm`` (fp32 partial sums reduced in a tree). On the CPU each
    tensor's squares are summed in float64: torch's fp32 CPU norm accumulates serially, 9e-6 off
    at 10^6 elements and 3.6e-4 at 10^7 (torch 2.13), where a sharded engine's norm
    (:func:`ember.dist.adapters.grad_norm`) sums in float64 too."""
    if tensors[0].device.type != "cpu":
        return torch.nn.utils.get_total_norm(tensors)
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    return torch.linalg.vector_norm(norms).to(tensors[0].dtype)


def read_later(value: torch.Tensor) -> Callable[[], float]:
    """A scalar's value on the host, read without waiting for work queued after it: on CUDA a
    copy into pinned memory and an event now, and the wait (for that copy alone) when the result
    is asked for."""
    if value.device.type != "cuda":
        return lambda: float(value)
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value.detach().reshape(()), non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def result() -> float:
        done.synchronize()
        return float(host)

    return result


class AdapterOptimizer:
    """``torch.optim.AdamW`` (fused on CUDA) plus ``clip_grad_norm_`` over one adapter's parameters."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        fused = bool(params) and params[0].device.type == "cuda"
        self.opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=fused)

    def has_grads(self) -> bool:
        """Whether any gradient has accumulated since the last step."""
        return any(p.grad is not None for p in self.params)

    def step(self, hp: AdamParams, grad_norm: Callable[[], torch.Tensor] | None = None) -> dict[str, float]:
        """Clip (if asked), update, clear gradients; returns ``grad_norm`` (before clipping).

        ``grad_norm`` computes the norm when the parameters are shards of a larger adapter (the
        norm of the whole adapter, from every rank); clipping then scales by it as
        ``clip_grad_norm_`` does."""
        hp.validate()
        for group in self.opt.param_groups:
            group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = None
        if grads:
            total = grad_norm() if grad_norm is not None else total_norm(grads)
            if hp.grad_clip_norm > 0:  # clip_grad_norm_'s scaling, on the device (nothing read back first)
                coef = torch.clamp(hp.grad_clip_norm / (total + 1e-6), max=1.0)
                torch._foreach_mul_(grads, coef.to(grads[0].device))
            norm = read_later(total)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # the norm read once the update is queued: the host goes on while the GPU updates
        return {"grad_norm": norm() if norm is not None else 0.0}

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping."""
        self.opt.zero_grad(set_to_none=True)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the Adam state of the (single, flat) parameter: ``step``, ``exp_avg``, ``exp_avg_sq``."""
        (p,) = self.params
        step_device = p.device if self.opt.defaults.get("fused") else "cpu"
        self.opt.state.clear()
        self.opt.state[p] = {
            "step": state["step"].reshape(()).to(step_device, torch.float32).clone(),
            "exp_avg": state["exp_avg"].to(p.device, p.dtype).clone(),
            "exp_avg_sq": state["exp_avg_sq"].to(p.device, p.dtype).clone(),
        }
