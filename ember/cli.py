"""The ``ember`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ember.engine_flags import CHECKPOINTING_MODES, WARMUP_MODES

DEFAULT_HOME = os.environ.get("EMBER_HOME", "~/.ember")


def _export(args: argparse.Namespace) -> int:
    """``ember export``: a checkpoint folder as a Hugging Face model (full fine-tuning) or a PEFT
    adapter (LoRA)."""
    import torch

    from ember.core.checkpoint import FULL_FORMAT, checkpoint_format, load_adapter
    from ember.core.config import load_config
    from ember.core.full_checkpoint import export_hf, load_full
    from ember.core.full_ft import clone_for_training, trainable_parameters
    from ember.core.loading import load_model

    def fail(msg: str) -> int:
        print(f"ember export: {msg}", file=sys.stderr)
        return 2

    for what, path in (("checkpoint", args.checkpoint), ("--base", args.base)):
        if not path.is_dir():
            return fail(f"{what} {path} is not a folder" if path.exists() else f"{what} {path} does not exist")
    if (args.checkpoint / "config.json").is_file() and not (args.checkpoint / "metadata.json").is_file():
        return fail(f"{args.checkpoint} is a Hugging Face model folder, not an Ember checkpoint: pass the "
                    "checkpoint first and the model it was trained from as --base")
    if (args.base / "metadata.json").is_file() and not (args.base / "config.json").is_file():
        return fail(f"--base {args.base} is an Ember checkpoint; pass the base model's Hugging Face folder")
    try:
        kind = checkpoint_format(args.checkpoint)
        meta = json.loads((args.checkpoint / "metadata.json").read_text())
        cfg = load_config(args.base)
    except (ValueError, OSError) as e:
        return fail(str(e))
    saved = meta.get("base_model") or {}
    for key in ("model_type", "vocab_size"):
        if key in saved and saved[key] != getattr(cfg, key):
            return fail(f"{args.checkpoint} was trained on a {key} of {saved[key]!r}; {args.base} has "
                        f"{getattr(cfg, key)!r}")
    if args.out.exists() and not args.overwrite:
        return fail(f"{args.out} exists (pass --overwrite to replace it)")
    print(f"loading {args.base}", file=sys.stderr)
    try:
        if kind == FULL_FORMAT:
            dtype = getattr(torch, next(iter(meta.get("parameters", {}).values()), "float32"))
            model = clone_for_training(load_model(args.base, "cpu", dtype))
            names = [n for n, _ in trainable_parameters(model)]
            try:
                load_full(model, args.checkpoint, names, with_optimizer=False)
            except ValueError as e:
                return fail(f"{e} (is {args.base} the model this checkpoint was trained from?)")
            export_hf(model, names, args.base, args.out, overwrite=args.overwrite,
                      progress=lambda line: print(line, file=sys.stderr), quantized=args.quantized)
        else:
            from ember.core.adapters import AdapterBank
            from ember.core.peft_format import export_peft

            model = load_model(args.base, "cpu", torch.float32)
            adapter = load_adapter(AdapterBank(model, max_adapters=1, max_rank=1024), args.checkpoint, False)
            export_peft(adapter, args.out, str(args.base), "peft")
    except (ValueError, OSError, NotImplementedError) as e:
        return fail(str(e))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ember.engine.demo import run_demo

    history = run_demo(steps=args.steps, device=args.device, out=args.out, seed=args.seed)
    ok = all(v[-1] < 0.5 * v[0] for v in history.values())
    print("both adapters learned their task" if ok else "losses did not halve; try more --steps")
    return 0 if ok else 1


def _train(args: argparse.Namespace) -> int:
    """``ember rl`` / ``ember sft``: load the config, run, print the held-out metrics."""
    import logging

    from ember.rl.config import RLConfig, SFTConfig, load_config, to_dict

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cls = RLConfig if args.command == "rl" else SFTConfig
    try:
        cfg = load_config(cls, args.config, args.set)
    except (ValueError, TypeError, OSError) as e:
        print(f"ember {args.command}: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    if args.command == "rl":
        from ember.rl.trainer import run_rl as run
    else:
        from ember.rl.sft import run_sft as run
    result = run(cfg)
    print(json.dumps(result, indent=2))
    return 0


def _database_url(args: argparse.Namespace) -> str:
    from ember.store.db import default_sqlite_url

    return args.database_url or os.environ.get("EMBER_DATABASE_URL") or default_sqlite_url(Path(args.home).expanduser())


def _check_layout(models: dict, nproc: int, ep: int, tp: int, expert_fsdp: bool = False) -> None:
    """Refuse at start, naming the sizes, a layout that does not divide what it splits."""
    from ember.core.config import TP_FAMILIES, load_config

    for name, m in models.items():
        cfg = load_config(m.path)
        moe = getattr(cfg, "moe", None)
        if expert_fsdp and moe is None:
            raise ValueError(f"--expert-fsdp needs MoE layers; {name!r} ({cfg.model_type}) has none")
        if ep > 1 and moe is not None and moe.num_experts % ep:
            raise ValueError(f"--ep {ep} must divide the {moe.num_experts} experts per MoE layer of {name!r}")
        if tp > 1:
            if cfg.model_type not in TP_FAMILIES:
                raise ValueError(f"--tp is built for {', '.join(TP_FAMILIES)} so far, not {cfg.model_type} ({name!r})")
            sizes = [("attention heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                     ("MLP width", cfg.intermediate_size), ("vocabulary entries", cfg.vocab_size)]
            # Inkling2's sliding-window layers have head counts of their own
            sizes += [(f"sliding-window {what}", int(cfg.raw[key])) for what, key in (
                ("attention heads", "swa_num_attention_heads"), ("key/value heads", "swa_num_key_value_heads"))
                if cfg.raw.get(key) is not None]
            for what, n in sizes:
                if n % tp:
                    raise ValueError(f"--tp {tp} must divide the {n} {what} of {name!r}")


def _check_engine_flags(args: argparse.Namespace) -> None:
    """The engine options' checks shared with the engine process, then the offload folder's."""
    from ember.engine_flags import engine_flag_errors, flag_values

    errors = engine_flag_errors(**flag_values(args))
    if errors:
        raise ValueError(errors[0])
    offload = args.optimizer_offload
    if offload.startswith("disk:"):
        folder = Path(offload[5:]).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--optimizer-offload folder {folder}: {e}") from None
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--optimizer-offload folder {folder} is not writable")


def _serve(args: argparse.Namespace) -> int:
    from ember.jsonlog import resolve_format
    from ember.server.config import ServerConfig
    from ember.server.quotas import Quotas
    from ember.server.serve import parse_model_flags, run
    from ember.server.supervisor import EngineOptions

    home = Path(args.home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    storage = args.storage or str(home / "checkpoints")
    database_url = _database_url(args)
    try:
        if storage.startswith("memory://"):
            raise ValueError(f"--storage {storage}: fsspec's memory:// lives in one process, and the API and each "
                             "engine run in processes of their own (on a Ray cluster, machines); use a folder or "
                             "an fsspec URL they all reach (file:///abs/path, s3://bucket/prefix, ...)")
        client_config = json.loads(args.client_config) if args.client_config else {}
        models = parse_model_flags(args.model or [], home)
        if not args.api_only:
            _check_engine_flags(args)
            _check_layout(models, args.nproc, args.ep, args.tp, args.expert_fsdp)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"ember serve: {e}", file=sys.stderr)
        return 2
    config = ServerConfig(
        models=models, database_url=database_url, storage=storage, auth=not args.no_auth, max_rank=args.max_rank,
        full_finetune=args.full_finetune,
        long_poll_s=args.long_poll, session_timeout_s=args.session_timeout, max_body_bytes=args.max_body_mb << 20,
        public_url=args.public_url, client_config=client_config,
        quotas=Quotas(training_runs=args.quota_training_runs, samplers=args.quota_samplers,
                      checkpoint_bytes=int(args.quota_checkpoint_gb * 2**30), queued_requests=args.quota_queued_requests),
    )
    engine = None if args.api_only else EngineOptions(
        database_url=database_url, storage=storage, device=args.device, dtype=args.dtype,
        max_adapters=args.max_adapters, max_rank=args.max_rank, token_budget=args.token_budget,
        gap_timeout_s=args.gap_timeout, log_level=args.log_level, cpu_threads=args.cpu_threads,
        stability_memory_mb=args.stability_memory_mb, stability_disk_mb=args.stability_disk_mb,
        stability_ttl_s=args.stability_ttl, log_format=resolve_format(args.log_format),
        nproc=args.nproc, ep=args.ep, tp=args.tp, expert_fsdp=args.expert_fsdp,
        activation_checkpointing=args.activation_checkpointing, rollout_precision=args.rollout_precision,
        max_prefill_tokens=args.max_prefill_tokens, warmup=args.warmup,
        ray=args.ray, full_finetune=args.full_finetune, optimizer_offload=args.optimizer_offload,
        optimizer_device_gib=args.optimizer_device_gib,
    )
    run(config, args.host, args.port, engine, args.log_level, args.log_format)
    return 0


def _keys(args: argparse.Namespace) -> int:
    from ember.store import Store

    store = Store.open(_database_url(args))
    if args.keys_command == "create":
        key_id, key = store.create_api_key(args.name)
        print(key)
        print(f"(key id {key_id}; only its hash is stored, so keep the key now)", file=sys.stderr)
    elif args.keys_command == "list":
        for k in store.list_api_keys():
            state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
            print(f"{k.id}\t{k.name or '-'}\tcreated {k.created_at:%Y-%m-%d %H:%M}\t{state}")
    else:
        if not store.revoke_api_key(args.key_id):
            print(f"no active key {args.key_id}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from sqlalchemy import select

    from ember.store import Store
    from ember.store.models import Session, TrainingModel
    from ember.store.repo import utcnow

    store = Store.open(_database_url(args))
    print("ENGINES")
    now = utcnow()
    for e in store.engines():
        stale = e.status == "ready" and e.heartbeat_at is not None and (now - e.heartbeat_at).total_seconds() > 10

        tps = e.tokens / e.busy_seconds if e.busy_seconds else 0.0
        print(f"  {e.base_model}: {e.status}{' (no heartbeat for >10 s)' if stale else ''} pid={e.pid} generation={e.generation} passes={e.passes} "
              f"tokens={e.tokens} ({tps:.0f} tok/s busy) heartbeat={e.heartbeat_at and e.heartbeat_at.strftime('%H:%M:%S')}"
              + (f" memory={_mib(e.memory_bytes)}" if e.memory_bytes is not None else "")
              + (f" detail={e.detail}" if e.detail else ""))
        if e.ranks:
            # a Ray engine's actors report their own memory: "rss" (the process's resident set,
            # on the CPU) or "cuda_allocated" (torch.cuda.memory_allocated of its GPU)
            print(f"    {len(e.ranks['ranks'])} processes, ep={e.ranks['ep']} tp={e.ranks['tp']}: "
                  + ", ".join(f"rank {r['rank']} pid={r['pid']} {r['device']}" + (f" node={r['node']}" if r.get("node") else "")
                              + (f" {r.get('memory', 'memory')}={_mib(r['memory_bytes'])}"
                                 if r.get("memory_bytes") is not None else "")
                              for r in e.ranks["ranks"]))
            if e.ranks.get("ray"):  # the engine's Ray actors: how many nodes, actors and GPUs
                ranks = e.ranks["ranks"]
                nodes = sorted({r.get("node_id") or r.get("node") for r in ranks})
                gpus = sum(str(r["device"]).startswith("cuda") for r in ranks)
                print(f"    ray: {len(nodes)} nodes, {len(ranks)} actors, {gpus} GPUs"
                      + "".join(f"; node {n[:12]}: ranks "
                                + ",".join(str(r["rank"]) for r in ranks if (r.get("node_id") or r.get("node")) == n)
                                for n in nodes))
    print("QUEUE (futures by base model and state)")
    for (base, state), n in sorted(store.queue_counts().items()):
        print(f"  {base}\t{state}\t{n}")
    with store.read() as s:
        sessions = list(s.scalars(select(Session).where(Session.status == "active").order_by(Session.created_at)))
        models = list(s.scalars(select(TrainingModel).where(TrainingModel.status.in_(("creating", "active")))
                                .order_by(TrainingModel.created_at)))
    print(f"ACTIVE SESSIONS ({len(sessions)})")
    for se in sessions:
        print(f"  {se.id}\towner={se.owner}\tlast heartbeat {se.last_heartbeat:%H:%M:%S}\t{se.display_name or ''}")
    print(f"LOADED MODELS ({len(models)})")
    for m in models:
        print(f"  {m.id}\t{m.base_model}\trank={m.lora['rank']}\tnext_seq={m.next_seq}\t{m.status}")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}MiB"


def _add_db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", default=DEFAULT_HOME, help=f"Ember's folder (default {DEFAULT_HOME}, or $EMBER_HOME)")
    p.add_argument("--database-url", default=None,
                   help="SQLAlchemy URL, e.g. postgresql://user@host/db (default: SQLite at HOME/ember.db, "
                   "or $EMBER_DATABASE_URL)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ember``."""
    parser = argparse.ArgumentParser(prog="ember", description="Ember: a LoRA-native Tinker-compatible engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the Tinker-compatible service (API + one engine per base model)",
        description="Serve the Tinker API. Point the official SDK at it with TINKER_BASE_URL=http://HOST:PORT "
        "and TINKER_API_KEY=<a key from `ember keys create`>. With no --model it serves a tiny built-in "
        "model (random weights, local tokenizer) built under --home on first use.",
    )
    _add_db_flags(serve)
    serve.add_argument("--model", action="append", metavar="[NAME=]PATH",
                       help="a local Hugging Face model folder to serve; NAME is what clients pass as base_model "
                       "(default: the folder name). Repeat for several models.")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--storage", default=None,
                       help="checkpoint root: a folder or an fsspec URL such as s3://bucket/prefix "
                       "(default HOME/checkpoints)")
    serve.add_argument("--no-auth", action="store_true", help="accept any tml- key (local use; one shared owner)")
    serve.add_argument("--device", default="cpu", help="torch device of the engines (default cpu)")
    serve.add_argument("--dtype", default=None, help="float32 | bfloat16 (default bfloat16 on CUDA, else float32)")
    serve.add_argument("--cpu-threads", type=int, default=None,
                       help="torch threads of each engine on --device cpu (default: all cores but one, which is "
                            "left to the API process and clients)")
    serve.add_argument("--nproc", type=int, default=1,
                       help="processes per engine (one GPU each with --device cuda; gloo on --device cpu) (default 1)")
    serve.add_argument("--ep", type=int, default=1,
                       help="expert-parallel degree: each of --ep processes holds 1/EP of every MoE layer's experts; "
                       "must divide --nproc and the number of experts (default 1)")
    serve.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel degree: --tp consecutive processes split the attention heads, the MLP "
                       "width and the vocabulary; must divide --nproc, the heads (Inkling2: also its sliding-window "
                       "layers'), the width and the vocabulary (default 1)")
    serve.add_argument("--expert-fsdp", action="store_true",
                       help="also shard each block of experts over the --nproc/--ep processes that hold it (FSDP2): "
                       "each keeps 1/(nproc/ep) of it, and a layer's block is gathered for its forward and backward "
                       "and freed after them, and gathered once per sampling run; needs MoE models and --nproc > --ep")
    serve.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="run each engine's --nproc processes as actors of the Ray cluster at ADDRESS (host:port of "
                       "its head, or auto: the cluster this machine belongs to), one per GPU (one CPU each with "
                       "--device cpu), in one placement group whose tensor-parallel groups never cross nodes; the API "
                       "process and the engine driver stay on this machine. Model folders must be readable at the "
                       "same paths on every node; --storage is a folder mounted alike on every node (checked at "
                       "start) or an fsspec URL, which only this machine reads and writes (the actors' checkpoint "
                       "folders travel through Ray) (docs/cluster.md)")
    serve.add_argument("--activation-checkpointing", default="auto", choices=CHECKPOINTING_MODES,
                       help="recompute each decoder layer's activations in the backward instead of keeping them, "
                       "for training passes (never sampling or forward-only ones): on (every layer), off, or auto: "
                       "in a pass whose estimated activations would not fit in the free GPU memory, first rebuild "
                       "norm and activation outputs in the backward, then checkpoint the fewest layers that make up "
                       "what is still missing; off on the CPU (default auto)")
    serve.add_argument("--rollout-precision", default="bf16", choices=("bf16", "fp8", "mxfp8"),
                       help="precision of the sampler's copy of the base attention/MLP projections and routed "
                       "experts (not embeddings, norms, routers or the LM head): bf16 (the model's own weights), "
                       "fp8 (e4m3 with 128x128 block scales, half the weight bytes, on Hopper: W8A8 products through "
                       "Triton kernels at decode batch sizes and scaled_mm above; 8.4 against 9.6 ms a bf16 step "
                       "for 64 sequences of a Qwen3-8B on an H100, docs/performance.md; else quantise-dequantise) or "
                       "mxfp8 (OCP MX: 32-element blocks with E8M0 scales, quantise-dequantise). Adapters stay in "
                       "the model dtype and training keeps the model's weights (default bf16)")
    serve.add_argument("--max-prefill-tokens", type=int, default=16384, metavar="N", help="tokens per sampling step: one decode token per running sequence, the rest for prompts; a longer prompt is prefilled in chunks over several steps while the running sequences keep decoding (dense, MoE, MLA and Gated DeltaNet families; qwen4_exp and Inkling2 prefill whole prompts). Smaller: shorter stalls of the running decodes, a later first token for long prompts (default 16384)")
    serve.add_argument("--warmup", default="auto", choices=WARMUP_MODES,
                       help="before an engine serves, run a short training pass and a sample on random tokens, so "
                       "that the first client does not wait for GPU kernels to be autotuned and compiled (on a fresh "
                       "machine minutes for the Gated DeltaNet families and Inkling2); `ember status` shows the engine "
                       "as 'warming up' meanwhile. auto: on CUDA devices (default auto)")
    serve.add_argument("--full-finetune", action="store_true",
                       help="let clients fully fine-tune the served models: create_lora_training_client(base_model, "
                       "rank=0) trains every weight of its own copy of the model (Ember's extension of the Tinker "
                       "API; how many runs fit is decided by memory); one process per engine (not with --nproc > 1 "
                       "or --ray)")
    serve.add_argument("--optimizer-offload", default="none", metavar="none|host|disk:DIR",
                       help="where full fine-tuning keeps its fp32 master weights and Adam moments: none (on the "
                       "device), host (pinned host memory), or disk:DIR (host memory, and files under DIR for what "
                       "it cannot hold); streamed through the device in chunks at each optimizer step (default none)")
    serve.add_argument("--optimizer-device-gib", type=float, default=0.0, metavar="GIB",
                       help="with --optimizer-offload host or disk:DIR: keep up to this many GiB of the optimizer state on the GPU anyway (whole parameters, the first ones), so fewer bytes cross the host link each step (ZeRO-Offload's partial offload; default 0: all of it off the GPU)")
    serve.add_argument("--max-adapters", type=int, default=32, help="LoRA adapter slots per base model (default 32)")
    serve.add_argument("--max-rank", type=int, default=64, help="largest LoRA rank accepted (default 64)")
    serve.add_argument("--token-budget", type=int, default=16384,
                       help="tokens per packed forward/backward pass across adapters (default 16384)")
    serve.add_argument("--session-timeout", type=float, default=300.0,
                       help="seconds without a heartbeat before a session ends and its adapters are freed (default 300)")
    serve.add_argument("--long-poll", type=float, default=25.0, help="seconds retrieve_future waits (default 25)")
    serve.add_argument("--gap-timeout", type=float, default=300.0,
                       help="seconds a model waits for a missing seq_id before skipping it (default 300)")
    serve.add_argument("--max-body-mb", type=int, default=64, help="largest request body in MiB (default 64)")
    serve.add_argument("--quota-training-runs", type=int, default=256,
                       help="training runs (models creating or active) one API key may hold; 0 = no limit (default 256)")
    serve.add_argument("--quota-samplers", type=int, default=16384,
                       help="samplers of active sessions one API key may hold (default 16384)")
    serve.add_argument("--quota-checkpoint-gb", type=float, default=1024.0,
                       help="GiB of checkpoints one API key may store (default 1024)")
    serve.add_argument("--quota-queued-requests", type=int, default=4096,
                       help="requests one API key may have queued or running; past it submits get 429 with "
                       "Retry-After (default 4096)")
    serve.add_argument("--stability-memory-mb", type=int, default=2048,
                       help="host memory per engine for stability records (sampling with record_stability_info, "
                       "for stable_reinforce) before the least recently used spill to local disk (default 2048)")
    serve.add_argument("--stability-disk-mb", type=int, default=16384,
                       help="local disk per engine for spilled stability records; past it the least recently used "
                       "are dropped and a datum naming one fails with that reason (default 16384)")
    serve.add_argument("--stability-ttl", type=float, default=3600.0,
                       help="seconds a stability record is kept without use (default 3600); records also go "
                       "when their session ends")
    serve.add_argument("--public-url", default=None, help="base URL for download links (default: the request's)")
    serve.add_argument("--client-config", default=None, metavar="JSON",
                       help='extra SDK flags for /api/v1/client/config, e.g. \'{"proto_compress_fwdbwd": true}\'')
    serve.add_argument("--api-only", action="store_true",
                       help="run only the API process; engines run elsewhere on the same database")
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument("--log-format", default="auto", choices=("auto", "text", "json"),
                       help="readable text lines or JSON lines on stderr (default auto: text on a terminal, "
                       "JSON otherwise)")
    serve.set_defaults(func=_serve)

    export = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face model (full fine-tuning) or a PEFT adapter (LoRA)",
        description="Export a checkpoint folder: a full fine-tuning checkpoint becomes a whole Hugging Face "
        "model folder (config, tokenizer and every tensor of the base checkpoint, with the trained values where "
        "the run trained them; what it never held, e.g. MTP layers, copied from BASE); a LoRA checkpoint "
        "becomes a PEFT adapter folder.")
    export.add_argument("checkpoint", type=Path, help="an Ember checkpoint folder (a downloaded save_state or "
                        "save_weights_for_sampler, or one under the server's --storage)")
    export.add_argument("--base", type=Path, required=True, help="the base model's local Hugging Face folder")
    export.add_argument("--out", type=Path, required=True, help="the folder to write")
    export.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    export.add_argument("--quantized", choices=("base", "dequantize"), default="base",
                        help="(full fine-tuning, quantized BASE: MXFP8, NVFP4, FP8 tiles) 'base' (default) writes "
                        "BASE's format: trained weights re-quantized by the format's recipe, the others copied "
                        "with their scales; 'dequantize' writes every quantized weight in the checkpoint's dtype, "
                        "without scales, and drops config.json's quantization_config")
    export.set_defaults(func=_export)

    keys = sub.add_parser("keys", help="create, list or revoke API keys", description="Manage API keys (stored hashed).")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("--name", default="", help="a label for the key")
    listing = keys_sub.add_parser("list", help="list keys (ids and labels, never the keys)")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    for p in (create, listing, revoke):
        _add_db_flags(p)
    keys.set_defaults(func=_keys)

    status = sub.add_parser("status", help="print engines, the queue, sessions and loaded models",
                            description="Reads the database directly; works while `ember serve` runs.")
    _add_db_flags(status)
    status.set_defaults(func=_status)

    demo = sub.add_parser(
        "demo",
        help="train two LoRA adapters on a tiny random model in shared packed batches",
        description="Two adapters learn different token-shift tasks in the same forward/backward passes; "
        "prints both losses, then saves checkpoints and PEFT exports.",
    )
    demo.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    demo.add_argument("--device", default="cpu", help="torch device (default cpu)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--out", type=Path, default=None, help="folder for checkpoints and PEFT exports")
    demo.set_defaults(func=_demo)
    from ember.rl.config import RLConfig, SFTConfig, describe_keys

    for name, what, cls in (
        ("rl", "RL (GRPO / DAPO / PPO / CISPO / GSPO) on a task through a Tinker-compatible service", RLConfig),
        ("sft", "supervised fine-tuning through a Tinker-compatible service", SFTConfig),
    ):
        p = sub.add_parser(
            name, help=what, formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="config keys (defaults; task options: kind = arithmetic | arithmetic_chain | math, with "
            "min_digits, max_digits, b_digits, ops, num_eval, grading, reward, turns, template | path, "
            "eval_path, question_key, answer_key, eval_fraction):\n" + describe_keys(cls),
            description=f"{what[0].upper() + what[1:]} (ember.rl; only the public tinker client API). The service is "
            "$TINKER_BASE_URL (or base_url in the config) with $TINKER_API_KEY. Writes metrics.jsonl, "
            "checkpoints.jsonl, config.json and plots/*.png to log_dir; a run whose log_dir holds a checkpoint "
            "resumes from it (weights, optimizer, data position, RNG). Example configs: examples/arithmetic/.",
        )
        p.add_argument("--config", "-c", type=Path, default=None, help="a .toml, .yaml or .json config file")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key (dotted for sections: loss.kind=cispo, sampling.max_tokens=8, "
                       "task.max_digits=3); repeatable")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.set_defaults(func=_train)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as e:
        extra = _EXTRAS.get(args.command)
        if extra is None or (e.name or "").split(".")[0] == "ember":
            raise
        print(f"ember {args.command} needs the {extra!r} extra, which is not installed (no module {e.name!r}): "
              f"pip install 'ember[{extra}]'", file=sys.stderr)
        return 2


# the optional dependencies of each command (pyproject.toml [project.optional-dependencies])
_EXTRAS = {"serve": "serve", "keys": "serve", "status": "serve", "rl": "rl", "sft": "rl"}


if __name__ == "__main__":
    sys.exit(main())
