"""Pre-quantized checkpoints (model/prequant.py): fp8 block-scaled (DeepSeek-V3 layout) and MXFP4 (gpt-oss).

Tiny random checkpoints are quantized here by each format's own rules (the quantizers below), saved
with their `quantization_config`, and loaded by our loader; the oracle is transformers running the
same weights dequantized by this file (and, for the formats' bit layouts, transformers' own
dequantizers). Configs we cannot read are refused naming their field.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mint_server.model.config import ModelConfig, ModelError, UnsupportedModelError
from mint_server.model.loader import load_model
from mint_server.model.prequant import (
    FP4_E2M1_VALUES,
    DequantizingReader,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
)
from tests.families.tiny_families import make_tiny_glm, make_tiny_gpt_oss
from tests.mla.test_mla_model import tokens_of
from tests.mla.tiny_deepseek import make_tiny_deepseek
from tests.moe.helpers import load_hf
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import for_model

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK = (16, 24)  # divides neither 64 nor 96 nor 128 on every side: partial blocks at the edges


# -- the formats' quantizers ----------------------------------------------------------------------
def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's rule: per [b0, b1] block, scale = amax / 448, q = fp8(w / scale); returns (q, scale_inv)."""
    rows, cols = w.shape[-2:]
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(*w.shape[:-2], nr * block[0], nc * block[1])
    padded[..., :rows, :cols] = w.float()
    tiles = padded.unflatten(-1, (nc, block[1])).unflatten(-3, (nr, block[0]))  # [..., nr, b0, nc, b1]
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)  # [..., nr, nc]
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float().contiguous()


def reference_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """This file's own dequantization: each element times its block's scale, by index."""
    rows, cols = q.shape[-2:]
    r = torch.arange(rows) // block[0]
    c = torch.arange(cols) // block[1]
    return q.float() * scale_inv[..., r[:, None], c[None, :]]


def quantize_mxfp4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's storage of a transformers expert stack t [E, A, B]: t transposed to [E, B, A], groups of
    32 along A, each with an e8m0 exponent (largest magnitude ≤ 6·2^e) and e2m1 codes, two per byte,
    the first of a pair in the low nibble. Returns (blocks [E, B, A/32, 16], scales [E, B, A/32])."""
    x = t.transpose(1, 2).float()
    groups = x.unflatten(-1, (x.shape[-1] // 32, 32))  # [E, B, G, 32]
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # nearest e2m1 magnitude
    code = code + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element by element: code k of a group is nibble k % 2 of byte k // 2, times 2^(scale − 127)."""
    lut = torch.tensor(FP4_E2M1_VALUES)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, B, G, 32]
    values = lut[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2)


# -- checkpoints ------------------------------------------------------------------------------------
def _fp8_target(name: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek's FP8 checkpoints quantize: linear weights (and fused expert stacks), not the
    embeddings, lm_head, norms or the router."""
    skipped = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "router")
    linear = (t.dim() == 2 and name.endswith(".weight")) or (t.dim() == 3 and ".experts." in name)
    return linear and t.is_floating_point() and not any(s in name for s in skipped)


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _write(src: Path, dest: Path, shards: list[dict[str, torch.Tensor]], quantization: dict | None) -> Path:
    """A copy of the checkpoint dir `src` with these weight shards and quantization_config."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(config))
    if len(shards) == 1:
        save_file(shards[0], str(dest / "model.safetensors"), metadata={"format": "pt"})
        return dest
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dest / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}


def fp8_pair(src: Path, dest: Path, scales_apart: bool = False) -> tuple[Path, Path]:
    """(the fp8 block-scaled checkpoint, the same weights dequantized by this file in fp32, no quantization_config).
    scales_apart: the scales in a second shard of their own (the loader must find them there)."""
    state = _state(src)
    quantized, scales, dequantized = {}, {}, {}
    for name, t in state.items():
        if _fp8_target(name, t):
            q, s = quantize_fp8_blocks(t, BLOCK)
            quantized[name], scales[f"{name}_scale_inv"] = q, s
            dequantized[name] = reference_fp8(q, s, BLOCK)
        else:
            quantized[name] = dequantized[name] = t.float() if t.is_floating_point() else t
    assert scales, "nothing was quantized"
    shards = [quantized, scales] if scales_apart else [{**quantized, **scales}]
    return (_write(src, dest / "fp8", shards, FP8_CONFIG), _write(src, dest / "dequantized", [dequantized], None))


def mxfp4_pair(src: Path, dest: Path) -> tuple[Path, Path]:
    """(gpt-oss with its expert stacks in MXFP4, as the Hub ships it; the same dequantized in fp32)."""
    quantized, dequantized = {}, {}
    for name, t in _state(src).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = quantize_mxfp4(t)
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = reference_mxfp4(blocks, scales).contiguous()
        else:
            quantized[name] = dequantized[name] = t.float() if t.is_floating_point() else t
    config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                  "model.embed_tokens", "lm_head"]}
    return _write(src, dest / "mxfp4", [quantized], config), _write(src, dest / "dequantized", [dequantized], None)


def check_loads_as_dequantized(quantized_dir: Path, dequantized_dir: Path) -> None:
    """Our model from the quantized dir holds exactly the dequantized weights, and its logits equal
    transformers' on those weights within the tolerance policy."""
    ours = load_model(quantized_dir, device="cpu")
    plain = load_model(dequantized_dir, device="cpu")
    assert ours.config.prequantized is not None and plain.config.prequantized is None
    theirs = plain.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), f"{name} differs from the dequantized weights"
    tokens = tokens_of(1, 2, 12)
    with torch.no_grad():
        for_model(ours.config).check(ours(tokens), load_hf(dequantized_dir)(tokens).logits,
                                     f"{quantized_dir.name} logits vs transformers on the dequantized weights")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pq-qwen3"), "qwen3", tie=False)


# -- the formats' bit layouts, against transformers' own dequantizers ---------------------------------
def test_fp8_block_dequantization_equals_transformers_on_partial_blocks():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(0)
    for shape in [(40, 56), (3, 33, 70)]:  # neither dim a multiple of its block; a 3-D expert stack
        q, s = quantize_fp8_blocks(torch.randn(shape), BLOCK)
        ours = dequantize_fp8_blocks(q, s, BLOCK)
        assert torch.equal(ours, reference_fp8(q, s, BLOCK))
        assert torch.equal(ours, _dequantize_fp8_weight(q, s, list(BLOCK), torch.float32))
    # e8m0 scales (DeepSeek-V3.1+'s scale_fmt ue8m0), stored as uint8 or float8_e8m0fnu, are powers of two
    q, s = quantize_fp8_blocks(torch.randn(40, 56), BLOCK)
    exponents = torch.ceil(torch.log2(s))
    as_uint8 = (exponents + 127).to(torch.uint8)
    want = reference_fp8(q, torch.exp2(exponents), BLOCK)
    assert torch.equal(dequantize_fp8_blocks(q, as_uint8, BLOCK), want)
    assert torch.equal(dequantize_fp8_blocks(q, torch.exp2(exponents).to(torch.float8_e8m0fnu), BLOCK), want)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    t = torch.randn(3, 64, 40) * torch.logspace(-3, 1, 64)[None, :, None]  # groups of very different scales
    blocks, scales = quantize_mxfp4(t)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == t.shape
    assert torch.equal(ours, reference_mxfp4(blocks, scales))
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # the quantizer above is MXFP4's: every value within half an e2m1 step of its group's scale
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1).transpose(1, 2)
    assert ((ours - t).abs() <= step + 1e-6).all()


# -- whole checkpoints ------------------------------------------------------------------------------
def test_fp8_dense_checkpoint_loads_dequantized_and_matches_transformers(qwen3_dir, tmp_path):
    check_loads_as_dequantized(*fp8_pair(qwen3_dir, tmp_path))


def test_fp8_loads_in_bf16_as_the_dequantized_weights_do(qwen3_dir, tmp_path):
    """A bf16 engine (CUDA's default) gets the bf16 rounding of the dequantized weights, as from a plain checkpoint."""
    quantized, dequantized = fp8_pair(qwen3_dir, tmp_path)
    ours = load_model(quantized, device="cpu", dtype=torch.bfloat16).state_dict()
    for name, t in load_model(dequantized, device="cpu", dtype=torch.bfloat16).state_dict().items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_tensor_parallel_slices_of_a_quantized_weight_are_slices_of_its_dequantization(qwen3_dir, tmp_path):
    """Scales follow whole blocks, so a rank's slice is cut from the dequantized weight (loader.read's get_slice)."""
    quantized, _ = fp8_pair(qwen3_dir, tmp_path)
    spec = ModelConfig.from_hf_dir(quantized).prequantized
    files = [quantized / "model.safetensors"]
    with safe_open(str(files[0]), framework="pt", device="cpu") as handle:
        reader = DequantizingReader(handle, spec, files)
        assert not [n for n in reader.keys() if n.endswith("_scale_inv")]
        name = "model.layers.0.mlp.down_proj.weight"
        whole = reader.get_tensor(name)
        part = reader.get_slice(name)
        assert part.get_shape() == list(whole.shape)
        assert torch.equal(part[:, 40:80], whole[:, 40:80]) and torch.equal(part[8:20], whole[8:20])
        plain = "model.embed_tokens.weight"  # stored unquantized: sliced as stored
        assert torch.equal(reader.get_slice(plain)[10:20], handle.get_tensor(plain)[10:20])


def test_fp8_fused_expert_stacks_load_with_their_3d_scales(tmp_path):
    """transformers' fused expert layout ([E, 2I, H] gate_up_proj): one scale grid per expert."""
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3_moe", tie=False, fused_experts=True)
    quantized, dequantized = fp8_pair(src, tmp_path)
    stacks = [k for k in load_file(str(quantized / "model.safetensors")) if k.endswith("experts.gate_up_proj_scale_inv")]
    assert stacks, "the fused stacks were not quantized"
    check_loads_as_dequantized(quantized, dequantized)


def test_fp8_scales_in_another_shard_are_found(qwen3_dir, tmp_path):
    quantized, dequantized = fp8_pair(qwen3_dir, tmp_path, scales_apart=True)
    assert len(list(quantized.glob("model-*.safetensors"))) == 2
    check_loads_as_dequantized(quantized, dequantized)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_fp8_mla_checkpoint_matches_transformers(family, tmp_path):
    """DeepSeek's own FP8 families, the V3.2 / GLM-5 indexer's projections quantized too."""
    if family == "glm_moe_dsa":
        src = make_tiny_glm(tmp_path / "src")
    else:
        src = make_tiny_deepseek(tmp_path / "src", "v3" if family == "deepseek_v3" else "v32")
    check_loads_as_dequantized(*fp8_pair(src, tmp_path))


def test_mxfp4_gpt_oss_checkpoint_matches_transformers(tmp_path):
    src = make_tiny_gpt_oss(tmp_path / "src")
    quantized, dequantized = mxfp4_pair(src, tmp_path)
    check_loads_as_dequantized(quantized, dequantized)
    # transformers itself reads the MXFP4 dir (dequantizing on CPU): the same logits
    model = load_model(quantized, device="cpu")
    tokens = tokens_of(3, 2, 12)
    with torch.no_grad():
        for_model(model.config).check(model(tokens), load_hf(quantized)(tokens).logits, "logits vs transformers' MXFP4")


# -- what is refused, by name -----------------------------------------------------------------------
@pytest.mark.parametrize(("quantization", "field"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
    ({"bits": 4}, "quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme"),
    ({**FP8_CONFIG, "scale_fmt": "int"}, "scale_fmt"),
    ({**FP8_CONFIG, "expert_dtype": "fp4"}, "expert_dtype"),
    ({"quant_method": "mxfp4"}, "quant_method"),  # MXFP4 is gpt-oss's layout, not Qwen3's
])
def test_unreadable_quantization_config_is_refused_naming_the_field(qwen3_dir, quantization, field):
    hf = json.loads((qwen3_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=rf"quantization_config\.{field}"):
        ModelConfig.from_hf_dict({**hf, "quantization_config": quantization})


def test_checkpoint_disagreeing_with_its_config_is_refused_naming_the_tensor(qwen3_dir, tmp_path):
    quantized, _ = fp8_pair(qwen3_dir, tmp_path)
    state = load_file(str(quantized / "model.safetensors"))
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"

    def variant(name: str, shard: dict[str, torch.Tensor], quantization: dict | None = FP8_CONFIG) -> Path:
        return _write(quantized, tmp_path / name, [shard], quantization)

    missing = variant("missing", {k: v for k, v in state.items() if k != scale})
    with pytest.raises(ModelError, match=r"'model.layers.0.self_attn.q_proj.weight' has no .*_scale_inv"):
        load_model(missing, device="cpu")
    wrong = variant("wrong-shape", {**state, scale: state[scale][:, :1].contiguous()})
    with pytest.raises(ModelError, match=r"q_proj.weight_scale_inv has shape \(\d+, 1\)"):
        load_model(wrong, device="cpu")
    unsaid = variant("no-config", state, None)
    with pytest.raises(ModelError, match="no quantization_config"):
        load_model(unsaid, device="cpu")


def test_mint_plan_prices_a_checkpoint_whose_quantization_the_loader_cannot_read(tmp_path):
    """`mint plan` reads only the shapes (weights are priced by --weight-bytes): Kimi-K2.5's config.json
    ships compressed-tensors int4, which loading refuses, and still has a plan."""
    from typer.testing import CliRunner

    from mint_server.cli import app

    config = json.loads((Path(__file__).resolve().parents[2] / "docs" / "configs" / "kimi-k2.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantization_config.quant_method 'compressed-tensors'"):
        ModelConfig.from_hf_dict(config)
    out = CliRunner().invoke(app, ["plan", "--config", str(path), "--gpus", "16", "--gpu-mem", "141", "--json"])
    assert out.exit_code == 0, out.output


def tp_sliced_load_equal(tp, ckpts: list[str]) -> list[bool]:
    """On each rank: reading only its share of a quantized checkpoint equals its share of the whole model."""
    from mint_server.model import tp as tpmod

    out = []
    for ckpt in ckpts:
        sliced = load_model(Path(ckpt), "cpu", torch.float32, tp=tp).state_dict()
        full = tpmod.shard_model(load_model(Path(ckpt), "cpu", torch.float32), tp).state_dict()
        out.append(sorted(sliced) == sorted(full) and all(torch.equal(sliced[k], full[k]) for k in full))
    return out


@pytest.mark.slow  # two spawned gloo ranks: ~60 s on 2 busy cores (the slicing rule itself is tested above)
def test_tensor_parallel_ranks_read_their_share_of_a_quantized_checkpoint(qwen3_dir, tmp_path):
    from tests.tp.harness import run_ranks

    dense, _ = fp8_pair(qwen3_dir, tmp_path / "dense")
    moe = make_tiny_checkpoint(tmp_path / "moe-src", "qwen3_moe", tie=False, fused_experts=True)
    fused, _ = fp8_pair(moe, tmp_path / "moe")
    assert run_ranks(tp_sliced_load_equal, [str(dense), str(fused)]) == [True, True]
