"""The family registry (model/families.py): one entry per supported family, each entry's pieces resolve
and answer for a real config of that family, and the shared code asks the entry instead of testing which
spec a config carries (a guard counts those tests outside the families' own files)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

import mint_server
from mint_server.model.config import FAMILIES, MODEL_TYPES, TEXT_MODEL_OF, ModelConfig
from mint_server.model.families import FAMILY_SPECS, family_spec, model_class_of
from mint_server.model.kv_cache import cache_pool_shapes, kv_bytes_per_token
from mint_server.model.lora import target_shapes
from mint_server.model.plan import count_params, kv_elems_per_token, plan
from mint_server.model.tp import TPNotSupportedError, check_supported
from mint_server.model.transformer import Transformer, rope_inv_freq

ROOT = Path(mint_server.__file__).parent
CONFIGS = Path(__file__).parents[2] / "docs" / "configs"
# The families' own files: their model code, their spec (config) module, and the registry itself.
FAMILY_FILES = {"families.py", "deepseek.py", "deepseek_v4.py", "glm_moe_dsa.py", "gpt_oss.py", "moe.py",
                "qwen35.py", "qwen3_vl.py", "recurrent_state.py", "mla_spec.py", "v4_spec.py", "hybrid_spec.py",
                "vision_spec.py"}
# A config's family spec tested against None (`cfg.mla is None`, `(hy := cfg.hybrid) is not None`) or
# picked by a conditional expression (`cfg.v4 if ... else`).
KIND_CHECK = re.compile(r"\.(mla|v4|hybrid|vision)\)? is (not )?None|\.(mla|v4|hybrid|vision) if ")
MAX_KIND_CHECKS = 4  # issue 51's goal (41 before the registry)


def _small(arch: str, **extra: object) -> dict:
    return {"architectures": [arch], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **extra}


def _family_configs() -> dict[str, dict]:
    """One HF config per family name: the frontier configs in docs/configs, small ones for the rest."""
    by_file = {p.stem: json.loads(p.read_text()) for p in CONFIGS.glob("*.json")}
    vl, hybrid = copy.deepcopy(by_file["qwen3-vl-30b-a3b"]), copy.deepcopy(by_file["qwen3.5-397b-a17b"])
    vl["architectures"] = ["Qwen3VLForConditionalGeneration"]
    hybrid.update(architectures=["Qwen3_5ForCausalLM"], intermediate_size=1024)
    return {
        "llama": _small("LlamaForCausalLM"), "qwen3": _small("Qwen3ForCausalLM", tie_word_embeddings=True),
        "qwen3_moe": _small("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            decoder_sparse_step=2),
        "deepseek_v3": by_file["kimi-k2"], "deepseek_v32": by_file["deepseek-v3.2"], "glm_moe_dsa": by_file["glm-5"],
        "deepseek_v4": by_file["deepseek-v4-flash"], "gpt_oss": by_file["gpt-oss-120b"],
        "qwen3_vl": vl, "qwen3_vl_moe": by_file["qwen3-vl-30b-a3b"],
        "qwen3_5": hybrid, "qwen3_5_moe": by_file["qwen3.5-397b-a17b"],
    }


def test_one_entry_per_family_and_every_model_type_reaches_one() -> None:
    assert set(FAMILY_SPECS) == {f.name for f in FAMILIES.values()}
    for model_type, arch in MODEL_TYPES.items():
        arch = TEXT_MODEL_OF.get(arch, arch)
        assert FAMILIES[arch].name in FAMILY_SPECS, model_type


@pytest.mark.parametrize("name", sorted(FAMILY_SPECS))
def test_each_entry_resolves_and_answers_for_its_family(name: str) -> None:
    cfg = ModelConfig.from_hf_dict(_family_configs()[name])
    assert cfg.family.name == name and family_spec(cfg) is FAMILY_SPECS[name]
    cls = model_class_of(cfg)
    assert issubclass(cls, Transformer), cls
    shapes = target_shapes(cfg)  # every target the entry names has a width
    assert shapes and all(layers > 0 and fi > 0 and fo > 0 for layers, fi, fo in shapes.values())
    params = count_params(cfg)
    assert params["attention"] > 0 and all(v >= 0 for v in params.values())
    latent, full = kv_elems_per_token(cfg)
    assert full > 0 and (latent is None or 0 < latent < full)
    assert cache_pool_shapes(cfg, 2, 16) and kv_bytes_per_token(cfg, torch.bfloat16) > 0
    assert len(rope_inv_freq(cfg)) == family_spec(cfg).rotary_dim(cfg) // 2
    p = plan(cfg, gpus=8, gpu_mem_gib=80, rank=16)
    assert p.params == params
    try:
        check_supported(cfg, 1)
    except TPNotSupportedError as e:  # only a family whose entry refuses every split
        assert str(e) == family_spec(cfg).tp_refusal(cfg, 1)


def test_the_shared_code_does_not_branch_on_a_family_kind() -> None:
    checks = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
              for path in sorted(ROOT.rglob("*.py")) if path.name not in FAMILY_FILES or path.parent.name != "model"
              for n, line in enumerate(path.read_text().splitlines(), 1) for _ in KIND_CHECK.finditer(line)]
    assert len(checks) <= MAX_KIND_CHECKS, "ask the family's entry (model/families.py) instead:\n" + "\n".join(checks)


def test_the_guard_sees_a_kind_check() -> None:
    assert KIND_CHECK.search("    if cfg.mla is not None and world > 1:")
    assert KIND_CHECK.search("    if (hy := cfg.hybrid) is not None:")
    assert KIND_CHECK.search("    v4 = cfg.v4 if isinstance(cfg, ModelConfig) else None")
    assert not KIND_CHECK.search("        if vision is not None:")  # a forward's image input, not a config
