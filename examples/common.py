"""What every example shares: its command line, the renderer choice, and the learning curve."""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# SmolLM2 speaks ChatML without thinking tags, the format of Qwen3's instruct models; the
# cookbook's model table does not list SmolLM2, so its renderer is named explicitly.
CHATML_RENDERER = "qwen3_instruct"


def parser(name: str, steps: int, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m examples.{name}", description=__doc__)
    p.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"),
                   help="MinT server (default $TINKER_BASE_URL or http://127.0.0.1:8000); the key is $TINKER_API_KEY.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Base model: hub id, short name or checkpoint dir.")
    p.add_argument("--renderer", default=None, help="Chat renderer (default: the cookbook's choice, else ChatML).")
    p.add_argument("--steps", type=int, default=steps, help="Training steps.")
    p.add_argument("--lr", type=float, default=lr, help="Learning rate.")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank.")
    p.add_argument("--out", type=Path, default=Path("runs") / name, help="Run dir: logs, metrics.csv, curve.png.")
    return p


def renderer_for(model: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    from tinker_cookbook import model_info
    from tinker_cookbook.exceptions import ConfigurationError

    try:
        return model_info.get_recommended_renderer_name(model)
    except (ConfigurationError, KeyError, ValueError):
        return CHATML_RENDERER


def read_metrics(log_dir: Path) -> list[dict[str, Any]]:
    """The cookbook's per-step metrics (metrics.jsonl), one dict per logged step."""
    rows = []
    path = log_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "step" in row:
                    rows.append(row)
    return rows


def write_curve(log_dir: Path, metric: str, title: str, extra: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """metrics.csv (step + every numeric metric) and curve.png (`metric`, and `extra`, per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Steps that logged the curve's metric (RL recipes add a last row of cumulative counters only).
    rows = [r for r in read_metrics(log_dir) if isinstance(r.get(metric), int | float)]
    if not rows:
        raise RuntimeError(f"{log_dir}/metrics.jsonl has no {metric!r}: did the run log any step?")
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, int | float) and k != "step"})
    csv_path, png_path = log_dir / "metrics.csv", log_dir / "curve.png"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *keys])
        for r in rows:
            w.writerow([r["step"], *(r.get(k, "") for k in keys)])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in (metric, *extra):
        points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), int | float)]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return csv_path, png_path
