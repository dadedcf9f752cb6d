"""Build a model from a local Hugging Face folder (``config.json`` + safetensors, sharded or not).

Checkpoint names map onto our modules by name. Per-expert MoE weights
(``mlp.experts.{e}.gate_proj.weight`` …) are stacked into the fused ``gate_up_proj`` / ``down_proj``
parameters as transformers 5 does in memory; checkpoints already in the fused layout load as they are.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from ember.core import quant
from ember.core.config import ModelConfig, load_config
from ember.core.layers.norms import RMSNorm
from ember.core.models import CausalLM, model_class

_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# a table saved in row shards (``….shard_{i}.weight``: Qwen3.8-Flash-Next's n-gram memory), loaded whole
_SHARD_KEY = re.compile(r"^(?P<param>.*)\.shard_(?P<i>\d+)\.weight$")
# multimodal checkpoints (Qwen3.8-Flash-Next) keep the text model under ``model.language_model``
_TEXT_PREFIX = "model.language_model."


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder (from ``model.safetensors.index.json`` if present)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files


class CheckpointReader:
    """The tensors of a model folder by key, across shards. Quantized weights (MXFP8, NVFP4, FP8
    tiles: a ``X.weight`` with ``X.weight_scale`` / ``X.weight_scale_inv`` companions, see
    :mod:`ember.core.quant`) read as their
    dequantized fp32 values, and their scale tensors are not listed as keys."""

    def __init__(self, model_dir: str | Path):
        self._where: dict[str, Path] = {}
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    self._where[key] = path
        self._handles: dict[Path, object] = {}

    def _handle(self, key: str):
        path = self._where[key]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._handles[path]

    def _raw(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def _companions(self, key: str) -> dict[str, torch.Tensor]:
        return {sfx: self._raw(key + sfx) for sfx in quant.SCALE_SUFFIXES if key + sfx in self._where}

    def names(self) -> list[str]:
        """Every weight key (scale companions of quantized weights excluded)."""
        return [k for k in self._where if not self._is_companion(k)]

    def _is_companion(self, key: str) -> bool:
        return any(key.endswith(sfx) and key[: -len(sfx)] in self._where for sfx in quant.SCALE_SUFFIXES)

    def get(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor stored under ``key`` (dequantized to fp32 if it is stored quantized); with
        ``rows = (start, n)`` only those rows, read from the file by themselves (a quantized tensor
        is read whole, then narrowed)."""
        companions = self._companions(key)
        if rows is not None and not companions:
            start, n = rows
            return self._handle(key).get_slice(key)[start : start + n]
        t = self._raw(key)
        t = quant.dequantize(t, companions) if companions else t
        return t if rows is None else t.narrow(0, *rows)

    def rows(self, key: str) -> int:
        """How many rows the tensor under ``key`` has (its first dimension), without reading it."""
        if self._companions(key):
            return self.get(key).shape[0]
        return self._handle(key).get_slice(key).get_shape()[0]


def _fill(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter, naming both when their shapes disagree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {what} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def build_empty(cfg: ModelConfig) -> CausalLM:
    """The model's modules on the meta device (no memory), ready to be materialised."""
    with torch.device("meta"):
        return model_class(cfg)(cfg)


def host_memory(device: torch.device) -> tuple[torch.device, bool]:
    """Where the host-resident parameters of a model on ``device`` live: the CPU, and whether in
    pinned memory: when CUDA is available and the model is on a GPU, so that copies from them to the
    GPU run asynchronously (a CPU model makes no copies, and pinning would start a CUDA context)."""
    return torch.device("cpu"), torch.cuda.is_available() and device.type == "cuda"


def host_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters of ``model`` kept in host memory whatever its device: those each module names
    in its ``host_parameters`` (names relative to the module; e.g. the n-gram table of
    :class:`~ember.core.layers.ngram_memory.NGramEmbedding`)."""
    return {
        f"{prefix}.{n}" if prefix else n for prefix, mod in model.named_modules() for n in getattr(mod, "host_parameters", ())
    }


def _materialise(model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
    # a family may keep some parameters in fp32 whatever ``dtype`` (e.g. DeepSeek's router bias)
    keep_fp32 = tuple(getattr(model, "fp32_parameters", ()))
    host = host_parameter_names(model)
    host_device, pin = host_memory(device)
    for prefix, mod in model.named_modules():
        own = [(n, f"{prefix}.{n}" if prefix else n, p) for n, p in mod.named_parameters(recurse=False)]
        if not any(full in host for _, full, _ in own):
            mod.to_empty(device=device, recurse=False)
            continue
        if any(full not in host for _, full, _ in own) or any(True for _ in mod.buffers(recurse=False)):
            raise ValueError(f"{prefix}: a module with host-resident parameters must hold nothing else")
        # allocated on the host in the final dtype directly: never on ``device``, never twice
        for n, full, p in own:
            kind = torch.float32 if full.endswith(keep_fp32) else dtype
            t = torch.empty(p.shape, dtype=kind, device=host_device, pin_memory=pin)
            setattr(mod, n, torch.nn.Parameter(t, requires_grad=p.requires_grad))
    for name, p in model.named_parameters():
        if name not in host:
            p.data = p.data.to(torch.float32 if name.endswith(keep_fp32) else dtype)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    parallelize: Callable[[CausalLM], object] | None = None,
) -> CausalLM:
    """Load a model folder onto ``device`` with weights in ``dtype``.

    ``parallelize`` shards the model (still on the meta device) before anything is read, so a
    process reads only the weights it holds: the model's ``param_blocks`` (``{parameter name:
    (dim, start, length)}``, or ``(dim, [(start, length), ...])`` for several pieces, set by
    :mod:`ember.dist`) name the parameters that hold a block of the checkpoint's tensor (some
    experts, some rows or columns); a block of rows (``dim`` 0, one piece) is read from the file by
    itself, also from a table saved in row shards.

    Host-resident parameters: a module may name some of its own parameters in a
    ``host_parameters`` attribute (names relative to the module, e.g. Qwen3.8-Flash-Next's n-gram
    table, ``ngram_embedding.weight``); those are materialised on the CPU whatever ``device``, in
    pinned memory when the model is on a GPU (:func:`host_memory`), and never touch the device. The
    module's forward must read them there (see :mod:`ember.core.layers.ngram_memory`); anything
    that moves the whole model (``model.to``) would move them too, so nothing does."""
    device = torch.device(device)
    cfg = load_config(model_dir)
    model = build_empty(cfg)
    if parallelize is not None:
        parallelize(model)
    _materialise(model, device, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    blocks: dict[str, tuple] = getattr(model, "param_blocks", {})

    def block(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in blocks:
            return t
        dim, *where = blocks[name]
        pieces = where[0] if len(where) == 1 else [tuple(where)]
        return torch.cat([t.narrow(dim, start, n) for start, n in pieces], dim=dim)

    def row_block(name: str) -> tuple[int, int] | None:
        """``(start, n)`` if ``name`` holds one block of its tensor's rows."""
        spec = blocks.get(name)
        return (spec[1], spec[2]) if spec is not None and spec[0] == 0 and len(spec) == 3 else None

    def read(name: str, stored: str) -> torch.Tensor:
        rows = row_block(name)
        return reader.get(stored, rows) if rows is not None else block(name, reader.get(stored))
    filled: set[str] = set()
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    shards: dict[str, list[tuple[int, str]]] = defaultdict(list)
    # a family whose checkpoints use other names (or layouts) than its modules maps each key:
    # ``map_checkpoint_key(key) -> (parameter name, convert or None) | None (skip)``
    remap = getattr(model, "map_checkpoint_key", None)
    reader = CheckpointReader(model_dir)
    for key in reader.names():
        if remap is not None:
            mapped = remap(key)
            if mapped is not None and mapped[0] in params:
                name, convert = mapped
                t = reader.get(key)
                _fill(params[name], block(name, convert(t) if convert is not None else t), key)
                filled.add(name)
            continue
        stored = key
        if key.startswith(_TEXT_PREFIX):
            key = "model." + key[len(_TEXT_PREFIX) :]
        shard = _SHARD_KEY.match(key)
        if shard and f"{shard['param']}.weight" in params:
            shards[f"{shard['param']}.weight"].append((int(shard["i"]), stored))
            continue
        m = _EXPERT_KEY.match(key)
        if m:
            # experts of layers the model does not build (e.g. MTP layers), or of other ranks, are not read
            name, e = f"{m['prefix']}.gate_up_proj", int(m["e"])
            _, start, n = blocks.get(name, (0, 0, None))
            if name in params and start <= e and (n is None or e < start + n):
                experts[m["prefix"]][e - start][m["proj"]] = reader.get(stored)
            continue
        if key in params:
            _fill(params[key], read(key, stored), stored)
            filled.add(key)
    for name, parts in shards.items():
        # this process's rows [start, start + n) of the table (all of them unless it holds a block)
        dst = params[name]
        if name in blocks and row_block(name) is None:
            raise ValueError(f"{name}: a table saved in row shards can only be split by rows")
        start, n = row_block(name) or (0, dst.shape[0])
        row, got = 0, 0
        for _, stored in sorted(parts):
            rows = reader.rows(stored)
            lo, hi = max(row, start), min(row + rows, start + n)
            if lo < hi:
                _fill(dst[lo - start : hi - start], reader.get(stored, (lo - row, hi - lo)), stored)
                got += hi - lo
            row += rows
        if got != n or (row != n if name not in blocks else row < start + n):
            want = f"rows {start}..{start + n - 1}" if name in blocks else f"{n} rows"
            raise ValueError(f"{name}: checkpoint shards hold {row} rows, model expects {want}")
        filled.add(name)
    for prefix, per_expert in experts.items():
        gate_up, down = params.get(f"{prefix}.gate_up_proj"), params.get(f"{prefix}.down_proj")
        if gate_up is None or down is None:
            continue
        n = gate_up.shape[0]
        if sorted(per_expert) != list(range(n)):
            start = blocks.get(f"{prefix}.gate_up_proj", (0, 0, n))[1]
            have = [e + start for e in sorted(per_expert)][:5]
            raise ValueError(f"{prefix}: checkpoint has experts {have}…, this process expects {start}..{start + n - 1}")
        inter = gate_up.shape[1] // 2
        for e, t in per_expert.items():
            missing = {"gate_proj", "up_proj", "down_proj"} - set(t)
            if missing:
                raise ValueError(f"checkpoint lacks {prefix}.{e}.{min(missing)}.weight")
            _fill(gate_up[e, :inter], t["gate_proj"], f"{prefix}.{e}.gate_proj.weight")
            _fill(gate_up[e, inter:], t["up_proj"], f"{prefix}.{e}.up_proj.weight")
            _fill(down[e], t["down_proj"], f"{prefix}.{e}.down_proj.weight")
        filled |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    if cfg.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} weights, e.g. {missing[:5]}")
    return model.eval()


def init_random(model: CausalLM, seed: int = 0, std: float = 0.02) -> CausalLM:
    """Fill a materialised model with random weights (norms at their identity value)."""
    gens: dict[torch.device, torch.Generator] = {}  # host-resident parameters draw from their own
    norm_weights = {id(m.weight): m.zero_centred for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for _, p in model.named_parameters():
            if id(p) in norm_weights:
                p.fill_(0.0 if norm_weights[id(p)] else 1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                if p.device not in gens:
                    gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, std, generator=gens[p.device])
    return model


def random_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    parallelize: Callable[[CausalLM], object] | None = None,
) -> CausalLM:
    """A model of shape ``cfg`` with random weights, built directly on ``device`` (benchmarks);
    ``parallelize`` shards it first (as in :func:`load_model`), so a process builds only its part."""
    model = build_empty(cfg)
    if parallelize is not None:
        parallelize(model)
    _materialise(model, torch.device(device), dtype)
    return init_random(model, seed).eval()
