"""PEFT-format adapters: export for ``peft`` / serving stacks, and import.

Two layouts share PEFT's tensor names (``base_model.model.{module}.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]``) and differ where PEFT itself has no single convention:

* ``peft`` — what ``peft.PeftModel.from_pretrained`` loads onto a transformers 5 model: the LM head
  as ``lm_head``; MoE experts through ``target_parameters`` on the stacked ``gate_up_proj`` /
  ``down_proj`` (PEFT's ``ParamWrapper``: ``lora_A`` ``[E·r, in]`` expert-major, ``lora_B``
  ``[out, r·E]`` expert-minor; the inner wrapper's keys carry ``.base_layer``).
* ``tinker`` — what Tinker exports and tinker-cookbook's ``weights`` tools read
  (``shared/spec/tinker_api.md`` §4): the LM head as ``model.unembed_tokens``; experts as 3-D
  tensors ``experts.w1`` (gate), ``w3`` (up), ``w2`` (down) with ``lora_A`` ``[E, r, in]`` and
  ``lora_B`` ``[E, out, r]``. Ember's fused gate/up expert adapter is written as w1 and w3 sharing
  one ``lora_A``, which is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.core.adapters import CATEGORIES, Adapter, AdapterBank, LoraConfig
from ember.core.checkpoint import assign_weights, atomic_dir

PREFIX = "base_model.model."
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # PEFT target_parameters order (first = inner wrapper)
_TINKER_UNEMBED = "model.unembed_tokens"


def _expert_split(name: str) -> tuple[str, str] | None:
    """``(experts_prefix, param)`` for a stacked-expert LoRA name, else ``None``."""
    for p in _EXPERT_PARAMS:
        if name.endswith(f".experts.{p}"):
            return name[: -len(p) - 1], p
    return None


def adapter_to_peft(adapter: Adapter, layout: str = "peft") -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (by PEFT name) and the ``adapter_config.json`` dict for ``adapter`` in ``layout``."""
    if layout not in ("peft", "tinker"):
        raise ValueError(f"layout must be 'peft' or 'tinker', not {layout!r}")
    tensors: dict[str, torch.Tensor] = {}
    expert_rank = None
    modules: set[str] = set()
    params: list[str] = []
    for name, w in adapter.weights.items():
        A, B = w.A.detach().float().cpu().clone(), w.B.detach().float().cpu().clone()
        split = _expert_split(name)
        if split is None:
            key = name
            if name == "lm_head" and layout == "tinker":
                key = _TINKER_UNEMBED
            tensors[f"{PREFIX}{key}.lora_A.weight"] = A
            tensors[f"{PREFIX}{key}.lora_B.weight"] = B
            modules.add(key.rsplit(".", 1)[-1])
            continue
        experts, param = split
        E, r, _ = A.shape
        expert_rank = r
        if layout == "tinker":
            # one declared rank for every module: normalize_moe_lora's larger expert scale
            # (alpha / r_expert instead of alpha / r) is folded into B
            B = B * adapter.scale_multipliers.get(name, 1.0)
            if param == "gate_up_proj":
                inter = B.shape[1] // 2
                parts = {"w1": B[:, :inter], "w3": B[:, inter:]}
            else:
                parts = {"w2": B}
            for w_name, b in parts.items():
                tensors[f"{PREFIX}{experts}.{w_name}.lora_A.weight"] = A.clone()
                tensors[f"{PREFIX}{experts}.{w_name}.lora_B.weight"] = b.contiguous()
            modules.add("experts")
        else:
            inner = ".base_layer" if param == _EXPERT_PARAMS[0] else ""
            tensors[f"{PREFIX}{experts}{inner}.lora_A.weight"] = A.reshape(E * r, -1).contiguous()
            tensors[f"{PREFIX}{experts}{inner}.lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], r * E).contiguous()
            params.append(param)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.config.rank,
        "lora_alpha": adapter.config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "target_modules": sorted(modules),
        "ember_targets": sorted(adapter.config.targets),
        "ember_seed": adapter.config.seed,
    }
    if params:
        config["target_parameters"] = [f"mlp.experts.{p}" for p in _EXPERT_PARAMS if p in params]
        if expert_rank != adapter.config.rank:  # normalize_moe_lora: experts have rank / top_k
            config["rank_pattern"] = {rf"mlp\.experts\.{p}": expert_rank for p in params}
            config["ember_normalize_moe_lora"] = True
    return tensors, config


def export_peft(
    adapter: Adapter, path: str | Path, base_model: str, layout: str = "peft", overwrite: bool = False
) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` to the folder ``path``."""
    tensors, config = adapter_to_peft(adapter, layout)
    config["base_model_name_or_path"] = base_model
    with atomic_dir(path, overwrite) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return Path(path)


def peft_to_ember(
    tensors: dict[str, torch.Tensor], config: dict, categories: dict[str, str]
) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """Map PEFT-named tensors (either layout) to Ember's ``{module}.lora_A/B`` names; ``categories``
    maps each adaptable module of the model to its category (``attn``/``mlp``/``unembed``)."""
    rank = int(config["r"])
    expert_rank = rank
    patterns = config.get("rank_pattern") or {}
    if patterns:
        # the one per-module rank we write ourselves: normalize_moe_lora's expert rank
        expert_keys = {rf"mlp\.experts\.{p}" for p in _EXPERT_PARAMS}
        if not config.get("ember_normalize_moe_lora") or not set(patterns) <= expert_keys:
            raise ValueError("adapter_config.rank_pattern (per-module ranks) is not supported")
        expert_rank = int(next(iter(patterns.values())))
    if config.get("alpha_pattern"):
        raise ValueError("adapter_config.alpha_pattern (per-module alphas) is not supported")
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError("rsLoRA and DoRA adapters are not supported")
    out: dict[str, torch.Tensor] = {}
    tinker_experts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        if not key.startswith(PREFIX) or not key.endswith(".weight"):
            raise ValueError(f"unexpected tensor name {key!r} in PEFT adapter")
        body = key[len(PREFIX) : -len(".weight")]
        module, factor = body.rsplit(".", 1)
        if factor not in ("lora_A", "lora_B"):
            raise ValueError(f"unexpected tensor name {key!r} in PEFT adapter")
        if module == _TINKER_UNEMBED:
            module = "lm_head"
        leaf = module.rsplit(".", 1)[-1]
        if leaf in ("w1", "w2", "w3") and module.rsplit(".", 2)[-2] == "experts":
            tinker_experts.setdefault(module.rsplit(".", 1)[0], {}).setdefault(leaf, {})[factor] = t
            continue
        if module.endswith((".experts", ".experts.base_layer")):
            experts = module.removesuffix(".base_layer")
            order = config.get("target_parameters") or [f"mlp.experts.{p}" for p in _EXPERT_PARAMS]
            params = [p.rsplit(".", 1)[-1] for p in order]
            param = params[0] if module.endswith(".base_layer") else params[-1]
            if factor == "lora_A":
                t = t.reshape(-1, expert_rank, t.shape[-1])
            else:
                t = t.reshape(t.shape[0], expert_rank, -1).permute(2, 0, 1)
            out[f"{experts}.{param}.{factor}"] = t.contiguous()
            continue
        out[f"{module}.{factor}"] = t
    for experts, parts in tinker_experts.items():
        if "w1" in parts:
            a1, a3 = parts["w1"]["lora_A"], parts["w3"]["lora_A"]
            if not torch.equal(a1, a3):
                raise ValueError(
                    f"{experts}: separate gate (w1) and up (w3) expert adapters with different lora_A "
                    "cannot be represented by Ember's fused gate_up expert adapter"
                )
            out[f"{experts}.gate_up_proj.lora_A"] = a1
            out[f"{experts}.gate_up_proj.lora_B"] = torch.cat([parts["w1"]["lora_B"], parts["w3"]["lora_B"]], dim=1)
        if "w2" in parts:
            out[f"{experts}.down_proj.lora_A"] = parts["w2"]["lora_A"]
            out[f"{experts}.down_proj.lora_B"] = parts["w2"]["lora_B"]
    modules = {k.rsplit(".", 1)[0] for k in out}
    unknown = sorted(modules - set(categories))
    if unknown:
        raise ValueError(f"adapter targets modules this model does not have (or cannot adapt), e.g. {unknown[:3]}")
    lora = LoraConfig(
        rank=rank,
        alpha=float(config.get("lora_alpha", rank)),
        targets=frozenset(config.get("ember_targets") or {categories[m] for m in modules}),
        seed=int(config.get("ember_seed", 0)),
        normalize_moe_lora=bool(config.get("ember_normalize_moe_lora", False)) and layout_has_patterns(config),
    )
    if not lora.normalize_moe_lora:
        # a lower-rank expert adapter (e.g. a Tinker-layout normalize_moe_lora export, whose expert
        # scale is already folded into B) is held exactly by zero-padding it to the full rank
        for key in list(out):
            t = out[key]
            if ".experts." in key and key.endswith(".lora_A") and t.shape[-2] < rank:
                out[key] = torch.nn.functional.pad(t, (0, 0, 0, rank - t.shape[-2]))
            elif ".experts." in key and key.endswith(".lora_B") and t.shape[-1] < rank:
                out[key] = torch.nn.functional.pad(t, (0, rank - t.shape[-1]))
    if not lora.targets <= set(CATEGORIES):
        raise ValueError(f"unknown targets {sorted(lora.targets)}")
    return lora, out


def layout_has_patterns(config: dict) -> bool:
    """Whether a PEFT config declares per-module ranks (the ``peft`` layout of normalize_moe_lora)."""
    return bool(config.get("rank_pattern"))


def import_peft(bank: AdapterBank, path: str | Path, slot: int | None = None, select=None) -> Adapter:
    """Create an adapter in ``bank`` from a PEFT adapter folder (either layout); ``select`` picks
    what this process holds of the factors (its block of experts)."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    lora, named = peft_to_ember(tensors, config, {t.name: t.category for t in bank.targets})
    adapter = bank.create(lora, slot)
    try:
        assign_weights(adapter, select(named) if select is not None else named)
    except Exception:
        bank.free(adapter.slot)
        raise
    return adapter
