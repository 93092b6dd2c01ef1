"""`mint plan` on DeepSeek-V4 (the published Flash and Pro configs), GLM-5 and Kimi-K2.5; the V4 parameter count
equals the model's own, and its cache figure is what the paged cache holds."""

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from mint_server.cli import app
from mint_server.model.config import ModelConfig
from mint_server.model.deepseek_v4 import DeepseekV4Transformer
from mint_server.model.kv_cache import kv_bytes_per_token
from mint_server.model.plan import count_params, plan

CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"


def run_plan(name: str, *args: str) -> dict:
    out = CliRunner().invoke(app, ["plan", "--config", str(CONFIGS / name), "--gpus", "16", "--gpu-mem", "141",
                                   "--rank", "32", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_plan_counts_deepseek_v4_flash_and_pro():
    flash = run_plan("deepseek-v4-flash.json")
    assert 2.83e11 < sum(flash["params"].values()) < 2.85e11  # DeepSeek's 284 B
    assert flash["kv_bytes_per_token_floor"] == 2 * (21 * (512 + 128) / 4 + 20 * 512 / 128)  # 21 CSA, 20 HCA
    assert "DeepseekV4ForCausalLM" in flash["tp_note"]
    pro = run_plan("deepseek-v4-pro.json", "--weight-bytes", "1")
    assert 1.55e12 < sum(pro["params"].values()) < 1.6e12 and pro["fits"]
    cfg = ModelConfig.from_hf_dict(json.loads((CONFIGS / "deepseek-v4-flash.json").read_text()))
    assert flash["kv_bytes_per_token_full"] == kv_bytes_per_token(cfg, torch.bfloat16)


def test_plan_counts_kimi_k25_as_k2_and_glm5_through_the_v32_family():
    assert run_plan("kimi-k2.5.json")["params"] == run_plan("kimi-k2.json")["params"]
    hf = json.loads((CONFIGS / "glm-5.json").read_text())
    assert hf["architectures"] == ["GlmMoeDsaForCausalLM"]
    p = plan(ModelConfig.from_hf_dict({**hf, "architectures": ["DeepseekV32ForCausalLM"]}), gpus=16,
             gpu_mem_gib=141, rank=32, weight_bytes=1)
    assert 7.4e11 < sum(p.params.values()) < 7.5e11  # GLM-5's 744 B
    assert p.kv_bytes_per_token_latent == 78 * (512 + 64 + 128) * 2


def test_v4_count_equals_the_models_own(v4_dir):
    cfg = ModelConfig.from_hf_dir(v4_dir)
    with torch.device("meta"):
        model = DeepseekV4Transformer(cfg)
    held = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith(("tid2eid", "e_score_correction_bias")))
    counted = count_params(cfg)
    assert sum(counted.values()) == held and counted["indexer"] > 0 and counted["mhc"] > 0
