"""PNG plots of a run's metrics (matplotlib, headless)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("ember.rl")

RL_PANELS = [("reward", ["train/reward", "eval/reward"]), ("accuracy", ["train/accuracy", "eval/accuracy"]),
             ("logprob gap (sampler vs trainer)", ["gap/mean_abs_logprob_diff", "gap/k3_kl"])]
SFT_PANELS = [("loss (per target token)", ["train/loss", "eval/nll"]), ("accuracy", ["eval/accuracy"])]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` in the records that have it."""
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot_metrics(records: list[dict[str, Any]], out_dir: str | Path, panels: list[tuple[str, list[str]]]) -> list[Path]:
    """One PNG per panel with the panel's metrics against the step; returns the files written
    (none, with a warning, if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plots (pip install 'ember[rl]')")
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for title, keys in panels:
        lines = [(k, *series(records, k)) for k in keys]
        lines = [x for x in lines if x[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for k, xs, ys in lines:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=k)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / (title.split(" ")[0].replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
