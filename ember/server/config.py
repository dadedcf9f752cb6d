"""Settings of an ``ember serve`` API process and the base models it serves."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ember.server.quotas import Quotas
from ember.server.wire.training import ModelLimits


@dataclass(frozen=True)
class ServedModel:
    """A base model: the name clients pass as ``base_model`` and its local folder."""

    name: str
    path: Path
    arch: str
    limits: ModelLimits

    @classmethod
    def from_folder(cls, name: str, path: str | Path) -> ServedModel:
        """Read ``config.json`` of a Hugging Face model folder (no weights are loaded here)."""
        path = Path(path).expanduser().resolve()
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model folder {path} has no config.json")
        cfg = json.loads(cfg_file.read_text())
        text = cfg.get("text_config", cfg)
        limits = ModelLimits(
            vocab_size=int(text["vocab_size"]), max_seq_len=int(text.get("max_position_embeddings", 4096))
        )
        return cls(name=name, path=path, arch=str(cfg.get("model_type", "unknown")), limits=limits)


@dataclass
class ServerConfig:
    """Everything the API process needs (the CLI fills it from flags)."""

    models: dict[str, ServedModel]
    database_url: str
    storage: str
    auth: bool = True
    max_rank: int = 64
    full_finetune: bool = False  # rank-0 training clients (full fine-tuning) are accepted
    long_poll_s: float = 25.0
    session_timeout_s: float = 300.0
    reaper_interval_s: float = 5.0  # how often idle sessions and expired checkpoints are collected
    future_retention_s: float = 3600.0
    max_body_bytes: int = 64 * 1024 * 1024
    download_url_ttl_s: float = 3600.0
    jwt_ttl_s: float = 3600.0  # lifetime of the JWTs POST /auth/token issues (flag pjwt_auth_enabled)
    public_url: str | None = None  # base of download links; default: the URL the client used
    client_config: dict = field(default_factory=dict)  # extra flags for POST /api/v1/client/config
    quotas: Quotas = field(default_factory=Quotas)  # per API key
