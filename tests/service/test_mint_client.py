"""mindlab-toolkit 0.2.0 (tinker 0.22.0) against a live server: the JSON-era wire, `sk-` keys
through JWT exchange, and the two /api/v1/mint extensions, on the real engine."""

from __future__ import annotations

import math
from pathlib import Path

from tests.service.clients import mint_client_dir, run_script
from tests.service.live import BASE, KEY_A, KEY_SK, LR, LiveServer

SCRIPT = Path(__file__).with_name("mint_client_script.py")


def _run(server: LiveServer, key: str) -> dict:
    return run_script(SCRIPT, mint_client_dir(), {
        "MINT_BASE_URL": server.url, "MINT_API_KEY": key, "BASE_MODEL": BASE, "LEARNING_RATE": str(LR),
    })


def test_mint_client_with_sk_key(server: LiveServer) -> None:
    out = _run(server, KEY_SK)
    assert out["losses"][-1] < 0.9 * out["losses"][0], out["losses"]
    # Reverse KL is a divergence: zero against itself, non-negative per token otherwise.
    assert abs(out["self_kl"]) < 1e-5
    assert all(math.isfinite(x) and x >= 0 for x in out["rkl_loss"]) and out["rkl_metrics"]["loss:sum"] > 0
    assert "adapter_config.json" in out["archive"]


def test_mint_client_with_tml_key(server: LiveServer) -> None:
    out = _run(server, KEY_A)
    assert out["losses"][-1] < 0.9 * out["losses"][0], out["losses"]
    assert out["merged"].startswith("tinker://") and out["merged"].endswith("/sampler_weights/merged")
