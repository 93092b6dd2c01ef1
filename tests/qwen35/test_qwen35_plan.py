"""`mint plan` on a Qwen3.5-397B-A17B-shaped config (docs/configs): parameters, the KV of its 15 attention
layers, and the recurrent state every sequence holds in its 45 linear-attention layers."""

import json
from pathlib import Path

from typer.testing import CliRunner

from mint_server.cli import app

CONFIG = Path(__file__).resolve().parents[2] / "docs" / "configs" / "qwen3.5-397b-a17b.json"


def test_plan_counts_qwen35_397b():
    out = CliRunner().invoke(app, ["plan", "--config", str(CONFIG), "--gpus", "8", "--gpu-mem", "141",
                                   "--rank", "32", "--context", "32768", "--json"])
    assert out.exit_code == 0, out.output
    p = json.loads(out.output)
    assert 3.9e11 < sum(p["params"].values()) < 4.0e11  # a 397B-class model
    assert 5.0e9 < p["params"]["linear_attn"] < 5.6e9 and p["params"]["shared_experts"] > 0
    assert p["kv_bytes_per_token_full"] == 15 * 2 * 2 * 256 * 2  # only the attention layers keep K/V
    conv, state = 2 * 16 * 128 + 64 * 128, 64 * 128 * 128
    assert p["state_bytes_per_sequence"] == 45 * (conv * 3 * 2 + state * 4)  # conv in bf16, the state fp32
    assert p["kv_bytes_per_token_per_gpu"] == p["kv_bytes_per_token_full"] // 2  # 2 KV heads: 4 ranks share each
    assert p["state_bytes_per_sequence_per_gpu"] == -(-p["state_bytes_per_sequence"] // 8)  # 16 key heads split
    per_seq = 32768 * p["kv_bytes_per_token_per_gpu"] + p["state_bytes_per_sequence_per_gpu"]
    assert p["sequences_at_context"] == p["kv_budget_bytes_per_gpu"] // per_seq
    text = CliRunner().invoke(app, ["plan", "--config", str(CONFIG), "--gpus", "8", "--gpu-mem", "141"]).output
    assert "recurrent state per sequence" in text and "linear_attn" in text
