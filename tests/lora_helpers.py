"""Shared helpers for LoRA tests: random adapters and PEFT references."""

from __future__ import annotations

import torch

from ember.core.adapters import Adapter
from ember.core.peft_format import adapter_to_peft, peft_to_ember


def randomise(adapter: Adapter, seed: int, scale: float = 0.3) -> None:
    """Give every factor (B included) random values, so LoRA changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in adapter.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * scale)


def peft_model_like(hf_model, adapter: Adapter):
    """A PEFT model over ``hf_model`` holding ``adapter``'s factors (PEFT layout)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    tensors, cfg = adapter_to_peft(adapter, "peft")
    peft_cfg = PeftLoraConfig(
        r=cfg["r"],
        lora_alpha=cfg["lora_alpha"],
        target_modules=cfg["target_modules"] or None,
        target_parameters=cfg.get("target_parameters"),
        lora_dropout=0.0,
    )
    model = get_peft_model(hf_model, peft_cfg)
    result = set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


def peft_grads_as_ember(model, adapter: Adapter) -> dict[str, torch.Tensor]:
    """The PEFT model's LoRA gradients, renamed and reshaped to Ember's ``{module}.lora_A/B``."""
    from peft import get_peft_model_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    grads_by_name = {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    # get_peft_model_state_dict strips the adapter name; rebuild the same keys for gradients
    out = {}
    for key in state:
        if ".lora_" not in key:
            continue
        param_name = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        )
        out[key] = grads_by_name[param_name]
    _, cfg = adapter_to_peft(adapter, "peft")
    # categories only decide the LoraConfig targets, which this helper discards
    _, named = peft_to_ember(out, cfg, {name: "mlp" for name, _, _ in adapter.layout})
    return named
