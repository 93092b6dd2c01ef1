"""`mint export NAME@ALIAS DIR --merged`: the adapter folded into the base as a plain HF checkpoint.

transformers loads the merged dir, and its logits equal what our engine computes serving the adapter
on the unmerged base (the tolerance policy, tests/tolerance.py). The CLI runs in-process (typer's
runner) on a local catalog and through --server; refusals (a quantized base, fused experts) leave
nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mint_server.catalog import Catalog
from mint_server.cli import app
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, LoraBank
from mint_server.model.peft_io import LoraWeights, save_peft
from tests.model.test_parity import random_adapter
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import for_model

OWNER = "merge-owner"


def mint(*args: str, expect: int = 0) -> Any:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == expect, f"mint {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return json.loads(result.stdout) if expect == 0 else result.output


def publish(tmp_path: Path, base: Path, adapter: LoraWeights, cfg, name: str = "p") -> list[str]:
    """The adapter as revision NAME@1 of a local catalog; returns the CLI's location options."""
    save_peft(adapter, tmp_path / "adapter", base_model=str(base), cfg=cfg)
    data = tmp_path / "home"
    with Catalog.open(None, data_dir=data) as catalog:
        catalog.import_peft(OWNER, tmp_path / "adapter", name, base_model=str(base))
    return ["--data-dir", str(data), "--owner", OWNER]


def served_logits(base: Path, adapter: LoraWeights, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What our engine's model computes for the adapter on the unmerged base, and for the base alone."""
    model = load_model(base, device="cpu", dtype=torch.float32)
    bank = LoraBank(model.config, num_slots=1, max_rank=adapter.rank, device="cpu", dtype=torch.float32)
    bank.write(0, adapter.weights, adapter.rank, adapter.alpha)
    with torch.no_grad():
        return model(tokens, lora=bank.batch([0] * tokens.shape[0])), model(tokens)


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen3", False)])
def test_merged_export_logits_equal_the_served_adapter(tmp_path: Path, family: str, tie: bool) -> None:
    base = make_tiny_checkpoint(tmp_path / "base", family=family, tie=tie)
    model_cfg = load_model(base, device="cpu").config
    adapter = random_adapter(model_cfg, rank=4, seed=5, targets=ALL_TARGETS)  # lm_head included
    assert "lm_head" in adapter.weights
    where = publish(tmp_path, base, adapter, model_cfg)
    out = mint("export", "p@1", str(tmp_path / "merged"), "--merged", "--base-model", str(base), *where)
    assert out["merged"] is True and out["number"] == 1 and out["untied_embeddings"] is tie

    merged = tmp_path / "merged"
    names = {f.name for f in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".json") and n.startswith("adapter") for n in names)  # a model, not an adapter
    config = json.loads((merged / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    tensors, base_tensors = load_file(str(merged / "model.safetensors")), load_file(str(base / "model.safetensors"))
    # The input embedding stays the base's: the adapter's output-layer LoRA applies to lm_head only.
    assert torch.equal(tensors["model.embed_tokens.weight"], base_tensors["model.embed_tokens.weight"])
    assert ("lm_head.weight" in base_tensors) is not tie

    tokens = torch.randint(0, model_cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(7))
    served, bare = served_logits(base, adapter, tokens)
    assert (served - bare).abs().max().item() > 1e-2  # the adapter really changes the output
    for_model(model_cfg).check(hf_logits(merged, tokens), served, "merged checkpoint vs served adapter")


def test_merged_export_of_expert_lora_per_expert_base(tmp_path: Path) -> None:
    base = make_tiny_checkpoint(tmp_path / "base", family="qwen3_moe", tie=True)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in load_file(str(base / "model.safetensors"))
    model_cfg = load_model(base, device="cpu").config
    adapter = random_adapter(model_cfg, rank=2, seed=9)
    assert any(t.startswith("expert_") for t in adapter.weights)
    where = publish(tmp_path, base, adapter, model_cfg)
    mint("export", "p@1", str(tmp_path / "merged"), "--merged", "--base-model", str(base), *where)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    served, _ = served_logits(base, adapter, tokens)
    for_model(model_cfg).check(hf_logits(tmp_path / "merged", tokens), served, "merged MoE vs served adapter")


def test_merged_export_refuses_fused_experts(tmp_path: Path) -> None:
    base = make_tiny_checkpoint(tmp_path / "base", family="qwen3_moe", tie=True, fused_experts=True)
    model_cfg = load_model(base, device="cpu").config
    where = publish(tmp_path, base, random_adapter(model_cfg, rank=2, seed=1), model_cfg)
    err = mint("export", "p@1", str(tmp_path / "merged"), "--merged", "--base-model", str(base), *where, expect=2)
    assert "fused expert tensors" in err and "without --merged" in err
    assert not (tmp_path / "merged").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]  # no staging left


def test_merged_export_refuses_a_quantized_base(tmp_path: Path) -> None:
    base = make_tiny_checkpoint(tmp_path / "base", family="llama")
    model_cfg = load_model(base, device="cpu").config
    where = publish(tmp_path, base, random_adapter(model_cfg, rank=2, seed=1), model_cfg)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (base / "config.json").write_text(json.dumps(config))
    err = mint("export", "p@1", str(tmp_path / "merged"), "--merged", "--base-model", str(base), *where, expect=2)
    assert "is quantized" in err and "'fp8'" in err
    assert not (tmp_path / "merged").exists()


def test_merged_export_needs_a_local_base_and_no_moe_layout(tmp_path: Path) -> None:
    base = make_tiny_checkpoint(tmp_path / "base", family="llama")
    model_cfg = load_model(base, device="cpu").config
    adapter = random_adapter(model_cfg, rank=2, seed=1)
    save_peft(adapter, tmp_path / "adapter", base_model="someone/elses-model", cfg=model_cfg)
    data = tmp_path / "home"
    with Catalog.open(None, data_dir=data) as catalog:
        catalog.import_peft(OWNER, tmp_path / "adapter", "p")
    where = ["--data-dir", str(data), "--owner", OWNER]
    err = mint("export", "p@1", str(tmp_path / "m"), "--merged", *where, expect=2)
    assert "'someone/elses-model' is not a checkpoint dir on this machine" in err and "--base-model" in err
    err = mint("export", "p@1", str(tmp_path / "m"), "--merged", "--moe-layout", "packed", *where, expect=2)
    assert "--moe-layout" in err
    err = mint("export", "p@1", str(tmp_path / "m"), "--base-model", str(base), *where, expect=2)
    assert "--base-model is for --merged" in err
    assert not (tmp_path / "m").exists()


def test_merged_export_through_a_server(server: str, tmp_path: Path) -> None:
    """--server: the adapter comes over the wire (verified), the base is read from this machine."""
    base = make_tiny_checkpoint(tmp_path / "base", family="llama", tie=True)
    model_cfg = load_model(base, device="cpu").config
    adapter = random_adapter(model_cfg, rank=2, seed=4, targets=("q_proj", "down_proj", "lm_head"))
    save_peft(adapter, tmp_path / "adapter", base_model=str(base), cfg=model_cfg)
    remote = ["--server", server, "--api-key", "erin"]
    mint("import", str(tmp_path / "adapter"), "--policy", "remote", *remote)
    out = mint("export", "remote@1", str(tmp_path / "merged"), "--merged", "--base-model", str(base), *remote)
    assert out["untied_embeddings"] is True
    tokens = torch.randint(0, model_cfg.vocab_size, (1, 19), generator=torch.Generator().manual_seed(2))
    served, _ = served_logits(base, adapter, tokens)
    for_model(model_cfg).check(hf_logits(tmp_path / "merged", tokens), served, "merged via --server")
