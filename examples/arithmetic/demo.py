"""The arithmetic demo: a tiny model learns 2-digit addition on the CPU through Ember.

1. builds a small random Qwen3 with a character-level tokenizer (nothing downloaded);
2. starts ``ember serve`` with it on a free local port;
3. ``ember sft`` (examples/arithmetic/sft.toml): supervised fine-tuning on ``a+b=`` → ``c``;
4. ``ember rl`` (examples/arithmetic/rl.toml): GRPO from the SFT weights, reward = exact answer;
5. writes ``results.json`` (held-out accuracy before SFT, after SFT, after GRPO; wall times) and
   ``curve.png`` (held-out accuracy over both phases) to ``--out``.

    python examples/arithmetic/demo.py --out runs/arithmetic-demo

Extra ``--sft-set`` / ``--rl-set`` arguments override config keys (as ``--set`` does for the CLI).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# One token per character (the 256-byte alphabet + 3 specials), so every digit is its own token.
MODEL = dict(tokenizer_vocab=259, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, home: Path, port: int) -> subprocess.Popen:
    """``ember serve`` with the demo model (as ``arith``) until it reports its engine ready."""
    with open(home / "server.log", "ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--no-auth", "--home", str(home),
                                 "--port", str(port), "--model", f"arith={model_dir}", "--max-rank", "64"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited; see {home / 'server.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2) as r:
                if all(v == "ready" for v in json.load(r)["engines"].values()):
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("ember serve did not become ready")


def evals(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]


def plot_curve(sft: list[tuple[int, float]], rl: list[tuple[int, float]], sft_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s for s, _ in sft], [a for _, a in sft], "o-", label="SFT (cross-entropy)")
    ax.plot([sft_steps + s for s, _ in rl], [a for _, a in rl], "o-", label="GRPO (from the SFT weights)")
    ax.axvline(sft_steps, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("optimizer round (SFT steps, then RL steps)")
    ax.set_ylabel("held-out exact-match accuracy (greedy)")
    ax.set_title("2-digit addition, tiny model on CPU through ember serve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/arithmetic-demo"), help="output folder")
    parser.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from ember.engine.builtin import build_model
    from ember.rl.config import RLConfig, SFTConfig, load_config
    from ember.rl.metrics import read_metrics
    from ember.rl.sft import run_sft
    from ember.rl.trainer import run_rl

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, "qwen3", seed=0, **MODEL)
    home = out / "ember-home"
    home.mkdir(exist_ok=True)
    port = free_port()
    server = start_server(model_dir, home, port)
    os.environ.update(TINKER_BASE_URL=f"http://127.0.0.1:{port}", TINKER_API_KEY="tml-arithmetic-demo",
                      HF_HUB_OFFLINE="1")
    common = [f"tokenizer={model_dir}", "resume=false"]
    try:
        t_sft = time.monotonic()
        sft_cfg = load_config(SFTConfig, HERE / "sft.toml", [*common, f"log_dir={out / 'sft'}", *args.sft_set])
        sft = run_sft(sft_cfg)
        t_rl = time.monotonic()
        rl_cfg = load_config(RLConfig, HERE / "rl.toml", [*common, f"log_dir={out / 'rl'}",
                                                          f"init_from={sft['state_path']}", *args.rl_set])
        run_rl(rl_cfg)
        t_end = time.monotonic()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    sft_evals = evals(read_metrics(out / "sft" / "metrics.jsonl"))
    rl_evals = evals(read_metrics(out / "rl" / "metrics.jsonl"))
    plot_curve(sft_evals, rl_evals, sft_cfg.steps, out / "curve.png")
    results = {
        "accuracy_before_sft": sft_evals[0][1], "accuracy_after_sft": sft_evals[-1][1],
        "accuracy_after_grpo": rl_evals[-1][1], "best_grpo_accuracy": max(a for _, a in rl_evals),
        "held_out_problems": sft_cfg.eval_problems, "sft_steps": sft_cfg.steps, "grpo_steps": rl_cfg.steps,
        "wall_seconds": {"total": round(t_end - t0, 1), "sft": round(t_rl - t_sft, 1), "grpo": round(t_end - t_rl, 1)},
        "sft_curve": sft_evals, "grpo_curve": rl_evals,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("curve")}, indent=2))
    print(f"curve: {out / 'curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
