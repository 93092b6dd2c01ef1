"""Test helpers: small but valid PEFT LoRA directories with distinct contents."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

BASE_MODEL = "test/base-model"
LORA = {"rank": 2, "train_attn": True, "train_mlp": False, "train_unembed": False}
REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")


def write_peft(path: str | os.PathLike[str], seed: int = 0, *, rank: int = 2, extra_bytes: int = 0) -> Path:
    """A PEFT LoRA dir whose weights depend on `seed`; `extra_bytes` pads it (for slow writes)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["v_proj", "q_proj"],
        "base_model_name_or_path": BASE_MODEL,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, sort_keys=True))
    rng = np.random.default_rng(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{prefix}.lora_A.weight": rng.standard_normal((rank, 16)).astype(np.float32),
        f"{prefix}.lora_B.weight": rng.standard_normal((16, rank)).astype(np.float32),
    }
    if extra_bytes:
        tensors["padding"] = rng.standard_normal(extra_bytes // 4).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def read_dir(path: str | os.PathLike[str]) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file()}


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def python() -> str:
    return sys.executable
