"""Runs a custom loss program (see :mod:`ember.lossgraph`) on one datum's log-probabilities.

The program is interpreted node by node; every function and method is looked up in the tables of
:mod:`ember.lossgraph`, so an upload can call nothing else. Tensors a program creates are bounded in
size (a loss cannot allocate the device's memory away), and device constants mean the engine's
device. A program that fails at run time fails its own request, with the node that failed.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from ember.lossgraph import ATTRIBUTES, FUNCTIONS, METHODS, ProgramError
from ember.types import InvalidRequest

_MODULES = {"torch": torch, "operator": operator, "math": math}
MIN_ELEMENTS = 1 << 22  # a program may always make tensors of this many elements ...
ELEMENTS_PER_INPUT = 64  # ... or this many times the elements of its datum's inputs


def _resolve(name: str):
    if name == "getattr":
        return builtins.getattr
    head, *rest = name.split(".")
    obj = _MODULES[head]
    for part in rest:
        obj = getattr(obj, part)
    return obj


class LossProgram:
    """A validated program, callable as ``program(logprobs, inputs) -> (loss, metrics)``."""

    def __init__(self, program: dict, device: torch.device):
        self.name = program["name"]
        self.inputs = program["inputs"]
        self.nodes = program["nodes"]
        self.device = device
        self._fns: list[Any] = []
        for node in self.nodes:
            fn = None
            if node["op"] == "call_function":
                if node["target"] not in FUNCTIONS:
                    raise InvalidRequest(f"custom loss {self.name!r}: function {node['target']!r} is not allowed")
                fn = _resolve(node["target"])
            elif node["op"] == "call_method" and node["target"] not in METHODS:
                raise InvalidRequest(f"custom loss {self.name!r}: method {node['target']!r} is not allowed")
            elif node["op"] not in ("placeholder", "call_method", "output"):
                raise InvalidRequest(f"custom loss {self.name!r}: {node['op']!r} nodes are not allowed")
            self._fns.append(fn)

    @property
    def input_names(self) -> list[str]:
        """The ``loss_fn_inputs`` keys the loss reads, in parameter order (after logprobs)."""
        return [x["name"] for x in self.inputs[1:]]

    def __call__(self, logprobs: torch.Tensor, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        cap = max(MIN_ELEMENTS, ELEMENTS_PER_INPUT * (logprobs.numel() + sum(x.numel() for x in inputs)))
        values = [logprobs, *inputs]
        env: dict[str, Any] = {}
        for node, fn in zip(self.nodes, self._fns):
            op, target = node["op"], node["target"]
            if op == "placeholder":
                env[node["name"]] = values.pop(0)
                continue
            args = self._decode(node["args"], env)
            kwargs = {key: self._decode(value, env) for key, value in node["kwargs"].items()}
            if op == "output":
                return self._result(args[0])
            try:
                if op == "call_function":
                    if target == "getattr" and args[1] not in ATTRIBUTES:
                        raise ProgramError(f"getattr may read only {sorted(ATTRIBUTES)}")
                    _check_size(target, args, kwargs, cap)
                    out = fn(*args, **kwargs)
                else:
                    if not isinstance(args[0], torch.Tensor):
                        raise ProgramError(f"method {target!r} called on a {type(args[0]).__name__}, not a tensor")
                    _check_size(target, args, kwargs, cap)
                    out = getattr(args[0], target)(*args[1:], **kwargs)
            except (RuntimeError, TypeError, ValueError, IndexError) as e:
                raise ProgramError(f"custom loss {self.name!r}, node {node['name']!r} ({target}): {e}") from None
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() > cap:
                    raise ProgramError(
                        f"custom loss {self.name!r}, node {node['name']!r} ({target}) made a tensor "
                        f"of {t.numel()} elements; the limit for this datum is {cap}"
                    )
            env[node["name"]] = out
        raise ProgramError(f"custom loss {self.name!r} has no output node")

    def _result(self, out: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ProgramError(f"custom loss {self.name!r} must return a floating-point scalar loss, got {shape}")
        values = {}
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ProgramError(f"custom loss {self.name!r}: metric {key!r} must be a one-element tensor")
            values[key] = float(value.detach())
        return loss, values

    def _decode(self, arg: Any, env: dict[str, Any]) -> Any:
        if isinstance(arg, list):
            return [self._decode(a, env) for a in arg]
        if not isinstance(arg, dict):
            return arg
        ((kind, value),) = arg.items()
        if kind == "ref":
            return env[value]
        if kind == "tuple":
            return tuple(self._decode(a, env) for a in value)
        if kind == "dict":
            return {k: self._decode(a, env) for k, a in value.items()}
        if kind == "slice":
            return slice(*(self._decode(a, env) for a in value))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "float":
            return float(value)
        if kind == "dtype":
            return getattr(torch, value)
        if kind == "device":
            return self.device
        if kind == "layout":
            return torch.strided
        if kind == "memory_format":
            return getattr(torch, value)
        raise ProgramError(f"unknown argument kind {kind!r}")


def _sizes(values: Sequence[Any]) -> list[int]:
    """The integers of a size given as ``*ints`` or as one sequence."""
    if len(values) == 1 and isinstance(values[0], (list, tuple, torch.Size)):
        values = values[0]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _check_size(target: str, args: Sequence[Any], kwargs: dict, cap: int) -> None:
    """Refuse, before the call, a tensor-making call that asks for more than ``cap`` elements."""
    if target in ("torch.zeros", "torch.ones"):
        sizes = _sizes(args or [kwargs.get("size", ())])
    elif target == "torch.full":
        sizes = _sizes([args[0] if args else kwargs.get("size", ())])
    elif target in ("new_zeros", "new_ones"):
        sizes = _sizes(args[1:] or [kwargs.get("size", ())])
    elif target == "new_full":
        sizes = _sizes([args[1] if len(args) > 1 else kwargs.get("size", ())])
    elif target == "repeat":
        sizes = [args[0].numel(), *_sizes(args[1:] or [kwargs.get("repeats", ())])]
    elif target == "torch.arange":
        bounds = [float(a) for a in args if isinstance(a, (int, float))]
        start, end, step = 0.0, 0.0, float(kwargs.get("step", 1))
        if len(bounds) == 1:
            end = bounds[0]
        elif len(bounds) >= 2:
            start, end = bounds[:2]
            step = bounds[2] if len(bounds) > 2 else step
        start, end = float(kwargs.get("start", start)), float(kwargs.get("end", end))
        sizes = [math.ceil(abs(end - start) / abs(step))] if step else []
    else:
        return
    if math.prod(abs(s) for s in sizes) > cap:
        raise ProgramError(f"{target} asks for {math.prod(abs(s) for s in sizes)} elements; the limit is {cap}")
