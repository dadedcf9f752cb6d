"""``ember serve``: the API process (uvicorn) plus one engine process per base model."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

from ember.jsonlog import setup_logging
from ember.server.config import ServedModel, ServerConfig
from ember.server.supervisor import EngineOptions, EngineSupervisor

log = logging.getLogger("ember.serve")
BUILTIN_NAME = "ember-tiny-qwen3"  # ember.engine.builtin.BUILTIN_NAME (not imported: no torch here)


def builtin_model(home: Path) -> Path:
    """Build (first time) the tiny random model with a local tokenizer; in a subprocess, so the API
    process never imports torch."""
    folder = home.expanduser() / "models" / BUILTIN_NAME
    if not (folder / "config.json").is_file():
        log.info("building the built-in tiny model", extra={"path": str(folder)})
        subprocess.run([sys.executable, "-m", "ember.engine.builtin", str(home.expanduser())], check=True,
                       stdout=subprocess.DEVNULL)
    return folder


def parse_model_flags(flags: list[str], home: Path) -> dict[str, ServedModel]:
    """``--model [NAME=]PATH`` values (NAME defaults to the folder name); none = the built-in model."""
    if not flags:
        return {BUILTIN_NAME: ServedModel.from_folder(BUILTIN_NAME, builtin_model(home))}
    models = {}
    for flag in flags:
        name, sep, path = flag.partition("=")
        if not sep:
            name, path = Path(flag).expanduser().resolve().name, flag
        if name in models:
            raise ValueError(f"--model: the name {name!r} is given twice")
        models[name] = ServedModel.from_folder(name, path)
    return models


def run(config: ServerConfig, host: str, port: int, engine: EngineOptions | None, log_level: str = "INFO",
        log_format: str = "auto") -> None:
    """Serve until interrupted; ``engine=None`` runs the API alone (engines run elsewhere)."""
    import uvicorn

    from ember.server.app import create_app
    from ember.store import Store

    setup_logging(log_level, log_format)
    # uvicorn re-raises SIGTERM after its graceful shutdown; make that unwind through `finally`
    # (stopping the engines) instead of killing the process on the spot.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    store = Store.open(config.database_url)
    supervisor = EngineSupervisor(store, config.models, engine) if engine is not None else None
    if supervisor is not None:
        supervisor.start()
    try:
        app = create_app(config, store)
        log.info("serving", extra={"host": host, "port": port, "models": sorted(config.models),
                                   "auth": config.auth, "storage": config.storage,
                                   "console": f"http://{host}:{port}/console",
                                   "openai": f"http://{host}:{port}/oai/api/v1"})
        uvicorn.run(app, host=host, port=port, log_config=None, access_log=False, timeout_graceful_shutdown=5)
    finally:
        if supervisor is not None:
            supervisor.stop()
