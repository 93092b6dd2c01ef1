"""`mint plan` on the shipped GLM-5 and gpt-oss-120b configs: parameter counts and KV figures."""

import json
from pathlib import Path

from typer.testing import CliRunner

from mint_server.cli import app

CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"


def plan(name: str, *extra: str) -> dict:
    out = CliRunner().invoke(app, ["plan", "--config", str(CONFIGS / name), "--gpus", "8", "--gpu-mem", "141",
                                   "--rank", "32", "--json", *extra])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_plan_counts_glm_5():
    p = plan("glm-5.json", "--gpus", "16")
    assert 7.3e11 < sum(p["params"].values()) < 7.6e11  # a 744 B-class model
    assert p["params"]["indexer"] > 0 and p["params"]["shared_experts"] > 0
    assert p["kv_bytes_per_token_latent"] == 78 * (512 + 64 + 128) * 2  # latent + rope key + indexer key
    assert p["kv_bytes_per_token_full"] == 78 * 64 * (256 + 256) * 2


def test_plan_counts_gpt_oss_120b():
    p = plan("gpt-oss-120b.json")
    assert 1.16e11 < sum(p["params"].values()) < 1.18e11  # 116.8 B
    assert p["kv_bytes_per_token_latent"] is None and p["kv_bytes_per_token_full"] == 36 * 2 * 8 * 64 * 2
    assert p["kv_bytes_per_token_per_gpu"] == p["kv_bytes_per_token_full"] // 8  # K/V heads split over tp = 8
    assert (p["sliding_layers"], p["sliding_window"]) == (18, 128)
    # attention (q/k/v/o) + every expert's gate/up/down + lm_head, per unit of rank
    h, q, kv, inter, experts, vocab = 2880, 64 * 64, 8 * 64, 2880, 128, 201088
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + experts * 3 * (h + inter)
    assert p["lora_params_per_rank"] == 36 * per_layer + (h + vocab)
