"""mindlab-toolkit 0.2.0 (tinker 0.22.0) against a live server: the JSON-era wire, `sk-` keys
through JWT exchange, and the two /api/v1/mint extensions."""

from __future__ import annotations

from pathlib import Path

from tests.service.clients import mint_client_dir, run_script
from tests.service.live import KEY_A, KEY_SK, LiveServer

SCRIPT = Path(__file__).with_name("mint_client_script.py")


def test_mint_client_with_sk_key(fake_server: LiveServer) -> None:
    out = run_script(SCRIPT, mint_client_dir(), {
        "MINT_BASE_URL": fake_server.url, "MINT_API_KEY": KEY_SK, "BASE_MODEL": "fake/tiny",
    })
    assert out["losses"][-1] < out["losses"][0]
    assert "forward_backward_reverse_kl" in fake_server.engine.calls
    assert "interpolate" in fake_server.engine.calls


def test_mint_client_with_tml_key(fake_server: LiveServer) -> None:
    out = run_script(SCRIPT, mint_client_dir(), {
        "MINT_BASE_URL": fake_server.url, "MINT_API_KEY": KEY_A, "BASE_MODEL": "fake/tiny",
    })
    assert out["merged"].startswith("tinker://")
