"""The ``ember`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from ember.engine.demo import run_demo

    history = run_demo(steps=args.steps, device=args.device, out=args.out, seed=args.seed)
    ok = all(v[-1] < 0.5 * v[0] for v in history.values())
    print("both adapters learned their task" if ok else "losses did not halve; try more --steps")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ember``."""
    parser = argparse.ArgumentParser(prog="ember", description="Ember: a LoRA-native Tinker-compatible engine")
    sub = parser.add_subparsers(dest="command", required=True)
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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
