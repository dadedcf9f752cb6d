"""Build a model from a local Hugging Face folder (``config.json`` + safetensors, sharded or not).

Checkpoint names map onto our modules by name. Per-expert MoE weights
(``mlp.experts.{e}.gate_proj.weight`` …) are stacked into the fused ``gate_up_proj`` / ``down_proj``
parameters as transformers 5 does in memory; checkpoints already in the fused layout load as they are.
:func:`checkpoint_layout` is the one resolution of checkpoint keys to parameters (with each piece's
conversion and its inverse): :func:`load_model` reads through it and the whole-model export
(:func:`ember.core.full_checkpoint.export_hf`) writes back through it.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ember.core import quant
from ember.core.config import ModelConfig, load_config
from ember.core.layers.norms import RMSNorm
from ember.core.models import CausalLM, model_class
from ember.core.models.inkling2 import deinterleave_gate_up

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


# safetensors' dtype names (header ``dtype`` field) -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class CheckpointReader:
    """The tensors of a model folder by key, across shards. Quantized weights (MXFP8, NVFP4, FP8
    tiles: a ``X.weight`` with ``X.weight_scale`` / ``X.weight_scale_inv`` companions, see
    :mod:`ember.core.quant`) read as their dequantized fp32 values through :meth:`get`, and their
    scale tensors are not listed by :meth:`names`; :meth:`raw` and :meth:`scale_keys` give the
    stored bytes and the companions' keys (what a re-export copies)."""

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

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def raw(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key`` exactly as stored (quantized bytes stay quantized; any key,
        scale companions included)."""
        return self._handle(key).get_tensor(key)

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The stored dtype and shape of ``key``, from the file's header (no tensor read)."""
        piece = self._handle(key).get_slice(key)
        name = piece.get_dtype()
        if name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{key} is stored as {name}, a dtype Ember does not read")
        return _SAFETENSORS_DTYPES[name], tuple(piece.get_shape())

    def scale_keys(self, key: str) -> dict[str, str]:
        """``{suffix: stored key}`` of the scale companions of the weight ``key`` (``_scale``,
        ``_scale_2``, ``_scale_inv``); empty unless it is stored quantized."""
        return {sfx: key + sfx for sfx in quant.SCALE_SUFFIXES if key + sfx in self._where}

    def is_quantized(self, key: str) -> bool:
        """Whether the weight ``key`` is stored quantized (it has scale companions)."""
        return bool(self.scale_keys(key))

    def _companions(self, key: str) -> dict[str, torch.Tensor]:
        return {sfx: self.raw(k) for sfx, k in self.scale_keys(key).items()}

    def names(self) -> list[str]:
        """Every weight key (scale companions of quantized weights excluded), in file order."""
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
        t = self.raw(key)
        t = quant.dequantize(t, companions) if companions else t
        return t if rows is None else t.narrow(0, *rows)

    def rows(self, key: str) -> int:
        """How many rows the tensor under ``key`` has (its first dimension), without reading it."""
        if self._companions(key):
            return self.get(key).shape[0]
        return self._handle(key).get_slice(key).get_shape()[0]


# -- checkpoint layout: which checkpoint keys fill each parameter, and how ---------------------------

WHOLE, EXPERTS, ROWS = "whole", "experts", "rows"


def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`~ember.core.models.inkling2.deinterleave_gate_up`: ``[gate; up]``
    along dim 1 back to the released ``[g0, u0, g1, u1, …]``."""
    inter = gate_up.shape[1] // 2
    out = torch.empty_like(gate_up)
    out[:, 0::2], out[:, 1::2] = gate_up[:, :inter], gate_up[:, inter:]
    return out


# the inverse of each conversion a family's ``map_checkpoint_key`` may return (a conversion may also
# carry its own as an ``inverse`` attribute)
_INVERSES: dict[Callable, Callable] = {deinterleave_gate_up: interleave_gate_up}


def _inverse(convert: Callable | None) -> Callable | None:
    if convert is None:
        return None
    return getattr(convert, "inverse", None) or _INVERSES.get(convert)


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's share of a parameter: the stored ``key``, the ``index`` of the
    (whole, unsplit) parameter it fills (ints and slices; ``()``: all of it), and the conversion
    from the stored layout to the parameter's (``to_param``, ``None``: as stored) with its inverse
    (``to_checkpoint``; ``None`` for a conversion without a known inverse)."""

    key: str
    index: tuple = ()
    to_param: Callable[[torch.Tensor], torch.Tensor] | None = None
    to_checkpoint: Callable[[torch.Tensor], torch.Tensor] | None = None

    def from_checkpoint(self, stored: torch.Tensor) -> torch.Tensor:
        """The stored tensor in the parameter's layout (what goes at ``index``)."""
        return stored if self.to_param is None else self.to_param(stored)

    def from_param(self, param: torch.Tensor) -> torch.Tensor:
        """The inverse: this key's tensor, in the checkpoint's layout, cut from the whole parameter."""
        t = param[self.index] if self.index else param
        if self.to_param is None:
            return t
        if self.to_checkpoint is None:
            raise NotImplementedError(f"{self.key}: no inverse for the checkpoint conversion "
                                      f"{getattr(self.to_param, '__name__', self.to_param)!r}")
        return self.to_checkpoint(t)


@dataclass(frozen=True)
class Placement:
    """Where a parameter's values are in a checkpoint: ``kind`` ``"whole"`` (one key, or several
    that each fill all of it, the last read winning), ``"experts"`` (one key per expert and
    projection, ``index = (expert, rows)`` / ``(expert,)``) or ``"rows"`` (a table saved in row
    shards, ``index = (slice of rows,)``)."""

    param: str
    kind: str
    pieces: tuple[Piece, ...]


def checkpoint_layout(model: torch.nn.Module, reader: CheckpointReader) -> dict[str, Placement]:
    """``{parameter name: Placement}`` for every parameter of ``model`` that ``reader``'s checkpoint
    holds (keys the model has no parameter for, e.g. MTP layers or vision towers, are in none);
    indices refer to the whole parameter, before any split across processes (``param_blocks``:
    :func:`load_model` narrows them). The one reading of checkpoint keys: :func:`load_model` reads
    through it, :func:`~ember.core.full_checkpoint.export_hf` writes back through its inverses.

    Key resolution: a family with ``map_checkpoint_key(key) -> (parameter, convert or None) |
    None`` maps every key itself; otherwise a ``model.language_model.`` prefix reads as ``model.``,
    ``….shard_{i}.weight`` keys are row shards of ``….weight`` (in shard order), per-expert
    ``….experts.{e}.{gate,up,down}_proj.weight`` keys are rows of the fused ``gate_up_proj`` ``[E,
    2I, H]`` (gate first) and ``down_proj`` ``[E, H, I]``, and any other key names its parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    pieces: dict[str, list[Piece]] = defaultdict(list)
    kinds: dict[str, str] = {}
    shards: dict[str, list[tuple[int, str]]] = defaultdict(list)

    def add(name: str, kind: str, piece: Piece) -> None:
        kinds.setdefault(name, kind)
        pieces[name].append(piece)

    remap = getattr(model, "map_checkpoint_key", None)
    for stored in reader.names():
        if remap is not None:
            mapped = remap(stored)
            if mapped is not None and mapped[0] in params:
                name, convert = mapped
                add(name, WHOLE, Piece(stored, (), convert, _inverse(convert)))
            continue
        key = "model." + stored[len(_TEXT_PREFIX) :] if stored.startswith(_TEXT_PREFIX) else stored
        shard = _SHARD_KEY.match(key)
        if shard and f"{shard['param']}.weight" in params:
            shards[f"{shard['param']}.weight"].append((int(shard["i"]), stored))
            continue
        m = _EXPERT_KEY.match(key)
        if m:
            # experts of layers the model does not build (e.g. MTP layers) are in no placement
            gate_up, down, e = f"{m['prefix']}.gate_up_proj", f"{m['prefix']}.down_proj", int(m["e"])
            if gate_up in params and down in params:
                if m["proj"] == "down_proj":
                    add(down, EXPERTS, Piece(stored, (e,)))
                else:
                    inter = params[gate_up].shape[1] // 2
                    rows = slice(0, inter) if m["proj"] == "gate_proj" else slice(inter, 2 * inter)
                    add(gate_up, EXPERTS, Piece(stored, (e, rows)))
            continue
        if key in params:
            add(key, WHOLE, Piece(stored))
    for name, parts in shards.items():
        row = 0
        for _, stored in sorted(parts):
            n = reader.rows(stored)
            add(name, ROWS, Piece(stored, (slice(row, row + n),)))
            row += n
    return {name: Placement(name, kinds[name], tuple(p)) for name, p in pieces.items()}


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

    reader = CheckpointReader(model_dir)
    layout = checkpoint_layout(model, reader)
    filled: set[str] = set()
    # prefix -> this process's expert -> projection -> (parameter, piece)
    experts: dict[str, dict[int, dict[str, tuple[str, Piece]]]] = defaultdict(lambda: defaultdict(dict))
    for name, place in layout.items():
        if place.kind == WHOLE:
            for piece in place.pieces:
                if piece.to_param is None:
                    t = read(name, piece.key)
                else:
                    t = block(name, piece.from_checkpoint(reader.get(piece.key)))
                _fill(params[name], t, piece.key)
            filled.add(name)
        elif place.kind == EXPERTS:
            # experts of other ranks are not read
            prefix = name.rsplit(".", 1)[0]
            _, start, n = blocks.get(f"{prefix}.gate_up_proj", (0, 0, None))
            for piece in place.pieces:
                e = piece.index[0]
                if start <= e and (n is None or e < start + n):
                    experts[prefix][e - start][_EXPERT_KEY.match(piece.key)["proj"]] = name, piece
        else:
            # this process's rows [start, start + n) of the table (all of them unless it holds a block)
            dst = params[name]
            if name in blocks and row_block(name) is None:
                raise ValueError(f"{name}: a table saved in row shards can only be split by rows")
            start, n = row_block(name) or (0, dst.shape[0])
            row, got = 0, 0
            for piece in place.pieces:
                (span,) = piece.index
                lo, hi = max(span.start, start), min(span.stop, start + n)
                if lo < hi:
                    _fill(dst[lo - start : hi - start], reader.get(piece.key, (lo - span.start, hi - lo)), piece.key)
                    got += hi - lo
                row = span.stop
            if got != n or (row != n if name not in blocks else row < start + n):
                want = f"rows {start}..{start + n - 1}" if name in blocks else f"{n} rows"
                raise ValueError(f"{name}: checkpoint shards hold {row} rows, model expects {want}")
            filled.add(name)
    for prefix, per_expert in experts.items():
        n = params[f"{prefix}.gate_up_proj"].shape[0]
        if sorted(per_expert) != list(range(n)):
            start = blocks.get(f"{prefix}.gate_up_proj", (0, 0, n))[1]
            have = [e + start for e in sorted(per_expert)][:5]
            raise ValueError(f"{prefix}: checkpoint has experts {have}…, this process expects {start}..{start + n - 1}")
        for e, projections in per_expert.items():
            missing = {"gate_proj", "up_proj", "down_proj"} - set(projections)
            if missing:
                raise ValueError(f"checkpoint lacks {prefix}.{e}.{min(missing)}.weight")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name, piece = projections[proj]
                where = (e, *piece.index[1:])  # the piece's place, in this process's block of experts
                _fill(params[name][where], piece.from_checkpoint(reader.get(piece.key)), piece.key)
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
