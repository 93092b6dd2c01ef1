"""`mint plan` on the shipped Kimi-K2 and DeepSeek-V3.2 configs: parameter counts and the latent KV figures."""

import json
from pathlib import Path

from typer.testing import CliRunner

from mint_server.cli import app

CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"


def test_plan_counts_kimi_k2_and_v32():
    runner = CliRunner()
    out = runner.invoke(app, ["plan", "--config", str(CONFIGS / "kimi-k2.json"), "--gpus", "16", "--gpu-mem", "141",
                              "--rank", "32", "--json"])
    assert out.exit_code == 0, out.output
    k2 = json.loads(out.output)
    assert 1.02e12 < sum(k2["params"].values()) < 1.04e12  # a 1T-class model
    assert k2["kv_bytes_per_token_latent"] == 61 * (512 + 64) * 2
    assert k2["kv_bytes_per_token_full"] == 61 * 64 * (192 + 128) * 2
    v32 = json.loads(runner.invoke(app, ["plan", "--config", str(CONFIGS / "deepseek-v3.2.json"), "--gpus", "16",
                                         "--gpu-mem", "141", "--rank", "32", "--json"]).output)
    assert 6.6e11 < sum(v32["params"].values()) < 6.8e11
    assert v32["kv_bytes_per_token_latent"] == 61 * (512 + 64 + 128) * 2  # + the indexer key
    bad = runner.invoke(app, ["plan", "--config", "/nonexistent.json"])
    assert bad.exit_code == 2 and "--config" in bad.output
