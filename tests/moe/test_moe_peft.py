"""Expert LoRA on disk: packed and per-expert PEFT layouts, bit-exact conversion, catalog import/export."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mint_server.model.config import ModelError
from mint_server.model.loader import load_model
from mint_server.model.lora import LoraBank
from mint_server.model.moe_layout import moe_layout_of
from mint_server.model.peft_io import convert_peft_dir, load_peft, save_peft
from tests.catalog.helpers import subprocess_env
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf, merged_logits

MINT = shutil.which("mint", path=os.path.dirname(sys.executable)) or "mint"


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_packed_and_per_expert_round_trip_bit_exact(moe_mixed_dir, tmp_path):
    cfg = load_model(moe_mixed_dir, device="cpu").config
    adapter = random_adapter(cfg, rank=4, seed=7)
    save_peft(adapter, tmp_path / "packed", base_model="tiny-moe", cfg=cfg)
    packed = load_file(str(tmp_path / "packed" / "adapter_model.safetensors"))
    # 2 sparse layers × 3 projections × (A, B): one [E, r, in] / [E, out, r] pair each
    expert_keys = [k for k in packed if ".experts." in k]
    assert len(expert_keys) == 12 and packed["base_model.model.model.layers.2.mlp.experts.down_proj.lora_A.weight"].shape == (8, 4, 32)
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight" in packed  # the dense layer's MLP
    assert moe_layout_of(tmp_path / "packed") == "packed"

    convert_peft_dir(tmp_path / "packed", tmp_path / "per-expert", "per-expert")
    per_expert = load_file(str(tmp_path / "per-expert" / "adapter_model.safetensors"))
    assert len([k for k in per_expert if ".experts." in k]) == 12 * 8
    assert per_expert["base_model.model.model.layers.0.mlp.experts.5.up_proj.lora_B.weight"].shape == (32, 4)
    assert json.loads((tmp_path / "per-expert" / "adapter_config.json").read_text())["mint_moe_layout"] == "per-expert"
    save_peft(adapter, tmp_path / "direct", base_model="tiny-moe", cfg=cfg, moe_layout="per-expert")
    assert_same_tensors(per_expert, load_file(str(tmp_path / "direct" / "adapter_model.safetensors")))

    convert_peft_dir(tmp_path / "per-expert", tmp_path / "back", "packed")
    assert_same_tensors(packed, load_file(str(tmp_path / "back" / "adapter_model.safetensors")))
    for src in ("packed", "per-expert"):
        loaded = load_peft(tmp_path / src, cfg)
        assert (loaded.rank, loaded.alpha) == (adapter.rank, adapter.alpha)
        for t, (a, b) in adapter.weights.items():
            assert torch.equal(loaded.weights[t][0], a) and torch.equal(loaded.weights[t][1], b), (src, t)


def test_per_expert_export_gives_the_merged_reference_logits(moe_dir, tmp_path):
    model = load_model(moe_dir, device="cpu")
    cfg = model.config
    adapter = random_adapter(cfg, rank=3, seed=9)
    save_peft(adapter, tmp_path / "pe", base_model="tiny-moe", cfg=cfg, moe_layout="per-expert")
    loaded = load_peft(tmp_path / "pe", cfg)
    bank = LoraBank(cfg, num_slots=1, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(0, loaded.weights, loaded.rank, loaded.alpha)
    tokens = torch.randint(0, 320, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(tokens, lora=bank.batch([0, 0])) - merged_logits(load_hf(moe_dir), cfg, adapter, tokens)).abs()
    assert diff.max().item() <= 1e-4


def test_incomplete_per_expert_adapter_is_refused(moe_dir, tmp_path):
    cfg = load_model(moe_dir, device="cpu").config
    save_peft(random_adapter(cfg, 2, seed=1), tmp_path / "pe", base_model="x", cfg=cfg, moe_layout="per-expert")
    f = tmp_path / "pe" / "adapter_model.safetensors"
    tensors = load_file(str(f))
    del tensors["base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight"]
    save_file(tensors, str(f))
    with pytest.raises(ModelError, match="expert_gate_proj.*layer 1"):
        load_peft(tmp_path / "pe", cfg)


def mint(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([MINT, *args], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == expect, proc.stderr
    return proc


def test_catalog_stores_packed_and_exports_either_layout(moe_dir, tmp_path):
    cfg = load_model(moe_dir, device="cpu").config
    save_peft(random_adapter(cfg, 2, seed=4), tmp_path / "pe", base_model="tiny-moe", cfg=cfg, moe_layout="per-expert")
    save_peft(random_adapter(cfg, 2, seed=4), tmp_path / "packed", base_model="tiny-moe", cfg=cfg)
    data = ["--data-dir", str(tmp_path / "home")]
    mint("import", str(tmp_path / "pe"), "--policy", "moe", *data)  # per-expert in: stored packed
    mint("export", "moe@1", str(tmp_path / "stored"), *data)
    assert moe_layout_of(tmp_path / "stored") == "packed"
    stored = load_file(str(tmp_path / "stored" / "adapter_model.safetensors"))
    assert_same_tensors(stored, load_file(str(tmp_path / "packed" / "adapter_model.safetensors")))
    mint("export", "moe@1", str(tmp_path / "out-pe"), "--moe-layout", "per-expert", *data)
    assert_same_tensors(load_file(str(tmp_path / "out-pe" / "adapter_model.safetensors")),
                        load_file(str(tmp_path / "pe" / "adapter_model.safetensors")))
    mint("export", "moe@1", str(tmp_path / "out-p"), "--moe-layout", "packed", *data)
    assert_same_tensors(load_file(str(tmp_path / "out-p" / "adapter_model.safetensors")), stored)
    bad = mint("export", "moe@1", str(tmp_path / "x"), "--moe-layout", "stacked", *data, expect=2)
    assert "--moe-layout" in bad.stderr and not (tmp_path / "x").exists()
