"""Run configurations for ``ember rl`` and ``ember sft``: dataclasses read from a TOML, YAML or JSON
file, with ``--set key=value`` overrides (dotted keys reach nested sections: ``loss.kind=cispo``,
``sampling.max_tokens=8``, ``task.max_digits=3``). Unknown keys are errors that name the key and
list the allowed ones."""

from __future__ import annotations

import dataclasses
import json
import os
import types as pytypes
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Allowed names of the loss options (ember.rl.losses implements them). This module stays free of
# torch and tinker, so `ember --help` and the API process never load them.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
CORRECTIONS = ("none", "is", "tis", "icepop", "seq_mask", "seq_is")


@dataclass
class SamplingConfig:
    """How the policy samples."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None  # None: stop at EOS
    max_context: int | None = None  # end an episode whose next prompt would exceed this (tokens)


LOSS_KINDS = ("reinforce", "importance_sampling", "ppo", "cispo", "gspo", "stable_reinforce")
# ε defaults by loss: PPO with DAPO clip-higher (0.2 / 0.28), CISPO = Tinker's [0, 4], GSPO's paper values.
DEFAULT_EPS = {"ppo": (0.2, 0.28), "cispo": (1.0, 3.0), "gspo": (3e-4, 4e-4)}


@dataclass
class LossConfig:
    """The policy loss and its corrections (spec §5.2–5.7, 5.11, 5.12)."""

    kind: str = "ppo"  # reinforce | importance_sampling | ppo | cispo | gspo | stable_reinforce (server-side replay)
    eps_low: float | None = None  # ratio clip [1 − eps_low, 1 + eps_high]; None = the loss's default
    eps_high: float | None = None
    dual_clip: float | None = None  # c (e.g. 3) for A < 0; PPO only, custom backend
    aggregation: str = "token-mean"
    norm_len: int | None = None  # L_max of seq-mean-token-sum-norm (default: max response tokens)
    correction: str = "none"  # none | is | tis | icepop | seq_mask | seq_is  (on ρ = π_old/μ)
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mask_low: float = 0.999
    seq_mask_high: float = 1.002
    recompute_old_logprobs: bool = False  # one forward pass at the rollout params gives π_old (else π_old = μ)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_mode: str = "reward"  # reward: −coef·KL folded into the advantages | loss: a KL term in the loss (custom)
    kl_reference: str = "base"  # "base" (the base model) or a tinker:// sampler path
    backend: str = "auto"  # auto | server | custom

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        checks = [("kind", self.kind, LOSS_KINDS), ("aggregation", self.aggregation, AGGREGATIONS),
                  ("correction", self.correction, CORRECTIONS), ("kl_estimator", self.kl_estimator, ("k1", "k2", "k3")),
                  ("kl_mode", self.kl_mode, ("reward", "loss")), ("backend", self.backend, ("auto", "server", "custom"))]
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"loss.{name} = {value!r}; allowed: {', '.join(allowed)}")
        if self.dual_clip is not None and self.kind != "ppo":
            raise ValueError("loss.dual_clip applies to kind = 'ppo' only")
        if self.kind == "stable_reinforce":
            # the service replays the sampler's record itself: corrections other than its own
            # token TIS (loss.tis_cap) and a π_old recompute have no meaning there
            if self.correction not in ("none", "tis"):
                raise ValueError(f"loss.correction = {self.correction!r} does not apply to stable_reinforce; "
                                 "use 'none' or 'tis' (the service's token TIS over the sampler's support)")
            if self.recompute_old_logprobs or self.backend == "custom" or (self.kl_coef and self.kl_mode == "loss"):
                raise ValueError("stable_reinforce runs on the service (backend 'auto' or 'server'), without "
                                 "recompute_old_logprobs or a KL term in the loss (kl_mode = 'reward' works)")
        if self.backend == "server" and self.needs_custom():
            raise ValueError(f"loss.backend = 'server' cannot run {self.custom_reason()}; use 'auto' or 'custom'")

    def eps(self) -> tuple[float, float]:
        lo, hi = DEFAULT_EPS.get(self.kind, (0.2, 0.2))
        return (lo if self.eps_low is None else self.eps_low, hi if self.eps_high is None else self.eps_high)

    def custom_reason(self) -> str | None:
        if self.kind == "gspo":
            return "GSPO (a sequence-level ratio)"
        if self.dual_clip is not None:
            return "the dual clip"
        if self.kl_coef and self.kl_mode == "loss":
            return "a KL term in the loss"
        return None

    def needs_custom(self) -> bool:
        return self.custom_reason() is not None

    def use_custom(self) -> bool:
        return self.backend == "custom" or (self.backend == "auto" and self.needs_custom())


@dataclass
class OptimConfig:
    """AdamW (Tinker's ``AdamParams``) and the learning-rate schedule."""

    learning_rate: float = 1e-4
    schedule: str = "constant"  # constant | linear | cosine (decay to 0 at the last step)
    warmup_steps: int = 0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class RunConfig:
    """What every run has: the service, the model, logging and checkpoints."""

    base_model: str = ""
    base_url: str | None = None  # default: $TINKER_BASE_URL
    api_key: str | None = None  # default: $TINKER_API_KEY
    tokenizer: str | None = None  # a local tokenizer folder (default: the service's, via get_tokenizer)
    lora_rank: int = 32
    lora_seed: int | None = 0
    init_from: str | None = None  # tinker://…/weights/NAME: start from these weights (fresh optimizer)
    seed: int = 0
    steps: int = 100
    optim: OptimConfig = field(default_factory=OptimConfig)
    task: dict[str, Any] = field(default_factory=lambda: {"kind": "arithmetic"})
    eval_every: int = 10  # 0 = only before and after training
    eval_problems: int | None = None  # cap on held-out problems (None = all of the task's)
    save_every: int = 0  # checkpoint (state + data position + RNG) every N steps; 0 = only at the end
    log_dir: str = "runs/ember"
    resume: bool = True  # continue from log_dir's last checkpoint if there is one
    progress: bool = True
    plots: bool = True
    tensorboard: bool = False  # needs the tensorboard package
    wandb_project: str | None = None  # needs the wandb package

    def validate(self) -> None:
        if not self.base_model:
            raise ValueError("base_model is required (the name the service serves, e.g. a model folder)")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if "kind" not in self.task:
            raise ValueError("task.kind is required (arithmetic, arithmetic_chain, math)")
        if self.optim.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.schedule = {self.optim.schedule!r}; allowed: constant, linear, cosine")


@dataclass
class RLConfig(RunConfig):
    """``ember rl``: P prompts × G samples per step, optimised in mini-batches."""

    prompts_per_step: int = 64
    group_size: int = 8
    minibatch_prompts: int | None = None  # prompts per optimizer step (None = all P: one step per batch)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    normalize_by_std: bool = True  # off = Dr. GRPO
    leave_one_out: bool = False  # RLOO baseline
    std_scope: str = "group"  # group | batch (REINFORCE++)
    overlong_max_len: int | None = None  # DAPO soft overlong punishment: L_max ...
    overlong_cache_len: int = 0  # ... L_cache ...
    overlong_factor: float = 1.0  # ... and factor f (0.5 = half strength)
    overlong_filter: bool = False  # drop truncated responses from the loss
    dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards differ, sample until P groups
    max_gen_batches: int = 4  # dynamic sampling gives up after this many sampling rounds per step
    async_staleness: int = 0  # 0 = synchronous; k >= 1: sampling runs up to k policy versions ahead
    eval_samples: int = 1  # k samples per held-out problem
    eval_temperature: float = 0.0  # 0 = greedy

    def validate(self) -> None:
        super().validate()
        self.loss.validate()
        if self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError("prompts_per_step and group_size must be >= 1")
        if self.minibatch_prompts is not None and not 1 <= self.minibatch_prompts <= self.prompts_per_step:
            raise ValueError(f"minibatch_prompts must be in [1, prompts_per_step={self.prompts_per_step}], "
                             f"got {self.minibatch_prompts}")
        if self.std_scope not in ("group", "batch"):
            raise ValueError(f"std_scope = {self.std_scope!r}; allowed: group, batch")
        if self.overlong_max_len is not None and not 0 < self.overlong_cache_len <= self.overlong_max_len:
            raise ValueError("overlong_cache_len must be in (0, overlong_max_len]")
        if self.async_staleness < 0:
            raise ValueError(f"async_staleness must be >= 0, got {self.async_staleness}")


@dataclass
class SFTConfig(RunConfig):
    """``ember sft``: supervised fine-tuning on a task's problems or a prompt/completion JSONL file.

    ``data``: ``{kind = "task"}`` trains on ``task``'s problems with their reference answers; or
    ``{kind = "jsonl", path = ..., prompt_key = "prompt", completion_key = "completion"}``.
    """

    batch_size: int = 64
    data: dict[str, Any] = field(default_factory=lambda: {"kind": "task"})
    eval_max_tokens: int = 16

    def validate(self) -> None:
        super().validate()
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.data.get("kind") not in ("task", "jsonl"):
            raise ValueError(f"data.kind = {self.data.get('kind')!r}; allowed: task, jsonl")


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file as a nested dict (``.toml``, ``.yaml``/``.yml`` or ``.json``)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(text) or {}
    if path.suffix == ".json":
        return json.loads(text)
    raise ValueError(f"config {path}: expected .toml, .yaml, .yml or .json")


def parse_value(text: str) -> Any:
    """A ``--set`` value: YAML scalars and lists (``3``, ``0.5``, ``true``, ``null``, ``[1, 2]``), else text."""
    import yaml

    for number in (int, float):  # YAML 1.1 reads "1e-2" as text
        try:
            return number(text.strip())
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a nested dict (in place; returned for convenience)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise TypeError(f"--set {key}: {p!r} is not a section")
        node[parts[-1]] = parse_value(value)
    return raw


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a section (table), got {value!r}")
        return build(tp, value, where)
    if origin in (typing.Union, pytypes.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _coerce(a, value, where)
                except (TypeError, ValueError):
                    continue
        raise ValueError(f"{where} = {value!r} does not fit {tp}")
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    if origin is dict and isinstance(value, dict):
        return dict(value)
    if origin is list and isinstance(value, list):
        return list(value)
    if tp is Any:
        return value
    raise ValueError(f"{where} = {value!r}: expected {getattr(tp, '__name__', tp)}")


def build(cls: type, raw: dict[str, Any], where: str = "") -> Any:
    """Construct dataclass ``cls`` from a nested dict, type-checking and naming unknown keys."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join((where + '.' if where else '') + k for k in unknown)}; "
                         f"allowed{' in ' + where if where else ''}: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in raw.items()}
    for f in dataclasses.fields(cls):  # a dict section given in part keeps its other defaults (e.g. task.kind)
        if f.name in kwargs and isinstance(kwargs[f.name], dict) and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
            if isinstance(default, dict):
                kwargs[f.name] = {**default, **kwargs[f.name]}
    return cls(**kwargs)


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Read ``path`` (optional), apply ``overrides``, build and validate a ``cls`` (RLConfig/SFTConfig)."""
    raw = read_file(path) if path else {}
    apply_overrides(raw, overrides or [])
    cfg = build(cls, raw)
    cfg.validate()
    return cfg


def describe_keys(cls: type) -> str:
    """Every config key of ``cls`` with its default, one per line (for ``--help``)."""
    lines = []

    def walk(c: type, prefix: str) -> None:
        for f in dataclasses.fields(c):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                lines.append(f"  {prefix}{f.name} = {json.dumps(default)}")

    walk(cls, "")
    return "\n".join(lines)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain data (for config.json in the log folder)."""
    return dataclasses.asdict(cfg)


def service_env(cfg: RunConfig) -> dict[str, str]:
    """Keyword arguments for ``tinker.ServiceClient`` from the config or the environment."""
    out = {}
    base_url = cfg.base_url or os.environ.get("TINKER_BASE_URL")
    if base_url:
        out["base_url"] = base_url
    if cfg.api_key:
        out["api_key"] = cfg.api_key
    return out
