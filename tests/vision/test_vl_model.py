"""Qwen3-VL (dense and MoE) in our model code vs the transformers oracle: the config, the image
processor, logits with images (several per sequence, batched beside text-only rows), LoRA on the
language model (PEFT export loaded by transformers + PEFT), and training gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from mint_server.engine.interface import EngineError, NotSupportedError
from mint_server.model.config import ModelConfig
from mint_server.model.images import ImageProcessing, PromptImages
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, LoraBank, target_layers
from mint_server.model.peft_io import load_peft, save_peft
from tests.engine.helpers import AdapterRegistry, TrainRequest, preparer
from tests.engine.helpers import TrainerHarness as Trainer
from tests.model.test_parity import random_adapter
from tests.vision.helpers import (
    hf_inputs,
    image_chunk,
    image_input,
    load_hf,
    shared_hf,
    vl_preparer,
    vl_tolerance,
)
from tests.vision.tiny_qwen3vl import PREPROCESSOR, png

FIXTURES = ["vl_dir", "vl_moe_dir"]
TEXT = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
IMAGES = [(40, 24, 1), (24, 32, 2)]  # 5 × 3 and 3 × 4 tokens


@pytest.fixture(scope="module", params=FIXTURES)
def vl(request):
    model_dir = request.getfixturevalue(request.param)
    return model_dir, load_model(model_dir, device="cpu")


def ours(model, prep, inputs: list[types.ModelInput], lora=None) -> list[torch.Tensor]:
    """Our logits for each model input, as one right-padded batch (row i: inputs[i])."""
    prompts = [prep.prompt(m) for m in inputs]
    T = max(len(p.tokens) for p in prompts)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p.tokens)] = torch.tensor(p.tokens)
    positions = torch.arange(T).expand(len(prompts), T)
    vision = model.vision_input(positions, [(i * T, len(p.tokens), p.images) for i, p in enumerate(prompts)])
    with torch.no_grad():
        logits = model(tokens, positions, lora, vision=vision)
    return [logits[i, : len(p.tokens)] for i, p in enumerate(prompts)]


def test_config_reads_the_text_and_vision_configs(vl_dir, vl_moe_dir):
    cfg = ModelConfig.from_hf_dir(vl_dir)
    v = cfg.vision
    assert cfg.architecture == "Qwen3VLForConditionalGeneration" and cfg.family.vision and cfg.family.qk_norm
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.mrope_section) == (3, 64, 16, (2, 3, 3))
    assert (v.depth, v.patch_size, v.spatial_merge_size, v.deepstack_layers) == (3, 4, 2, (0, 2))
    assert cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings and cfg.vocab_size > v.image_token_id
    # LoRA goes on the language model only: the tower has no targets
    assert set(target_layers(cfg)) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                       "lm_head"}
    moe = ModelConfig.from_hf_dir(vl_moe_dir)
    assert moe.family.moe and moe.num_experts == 8 and moe.norm_topk_prob and moe.sparse_layers == (0, 1)
    assert not moe.tie_word_embeddings  # the top-level flag decides, as in transformers (text_config says true)
    assert {"expert_gate_proj", "expert_up_proj", "expert_down_proj"} <= set(target_layers(moe))


def test_image_processing_matches_transformers(vl_dir):
    """Resize, rescale, normalise and patch order equal transformers' Qwen2-VL processor (PIL backend)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = ModelConfig.from_hf_dir(vl_dir)
    proc = ImageProcessing.for_model(cfg.vision, vl_dir)
    hf = Qwen2VLImageProcessorPil(min_pixels=PREPROCESSOR["size"]["shortest_edge"],
                                  max_pixels=PREPROCESSOR["size"]["longest_edge"], patch_size=4, merge_size=2,
                                  temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    import io

    from PIL import Image

    for w, h in [(40, 24), (37, 23), (90, 70), (9, 11)]:  # exact, rounded, shrunk to max_pixels, grown to min_pixels
        data = png(w, h, seed=w)
        mine = proc.read(data, "png", start=0)
        ref = hf(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        assert mine.grid == tuple(ref["image_grid_thw"][0]), (w, h)
        np.testing.assert_allclose(mine.patches, ref["pixel_values"], atol=1e-6, rtol=0)
        assert mine.tokens == int(np.prod(ref["image_grid_thw"][0])) // 4


def test_rope_positions_match_transformers_get_rope_index(vl_dir):
    cfg = ModelConfig.from_hf_dir(vl_dir)
    prep = vl_preparer(cfg, vl_dir)
    mi = image_input(cfg, TEXT, IMAGES)
    p = prep.prompt(mi)
    hf = shared_hf(vl_dir)
    inputs = hf_inputs(cfg, vl_dir, mi)
    ref, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    n = len(p.tokens)
    np.testing.assert_array_equal(p.images.rope_positions(np.arange(n)), ref[:, 0].numpy())
    # generated tokens continue from the prompt's last rotary position (transformers' rope_deltas)
    np.testing.assert_array_equal(p.images.rope_positions(np.arange(n, n + 3)),
                                  np.repeat(np.arange(n, n + 3)[None] + int(delta), 3, axis=0))


def test_logits_with_images_match_transformers(vl):
    model_dir, model = vl
    cfg = model.config
    prep = vl_preparer(cfg, model_dir)
    with_images = image_input(cfg, TEXT, IMAGES)
    text_only = types.ModelInput.from_ints([5, 6, 7, 8, 9])
    got = ours(model, prep, [with_images, text_only])  # batched: padding and a text row beside the image row
    hf = shared_hf(model_dir)
    with torch.no_grad():
        ref = hf(**hf_inputs(cfg, model_dir, with_images)).logits[0]
        ref_text = hf(**hf_inputs(cfg, model_dir, text_only)).logits[0]
        blank = hf(input_ids=hf_inputs(cfg, model_dir, with_images)["input_ids"]).logits[0]  # no pixels
    tol = vl_tolerance(cfg)
    tol.check(got[0], ref, "logits with two images")
    tol.check(got[1], ref_text, "text-only row")
    assert (got[0] - ref).abs().max().item() <= 1e-4  # the bound
    assert (ref - blank).abs().max().item() > 1e-2  # the images do steer the logits


def test_lora_logits_match_transformers_peft(vl, tmp_path):
    """Our PEFT export loads into transformers + PEFT (modules under model.language_model.) and gives our
    logits (MoE: transformers with the adapter merged, as PEFT cannot target fused expert parameters)."""
    from peft import PeftModel

    model_dir, model = vl
    cfg = model.config
    adapter = random_adapter(cfg, rank=4, seed=3, targets=ALL_TARGETS)
    save_peft(adapter, tmp_path / "a", str(model_dir), cfg)
    back = load_peft(tmp_path / "a", cfg)
    assert set(back.weights) == set(adapter.weights)
    bank = LoraBank(cfg, num_slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(1, adapter.weights, adapter.rank, adapter.alpha)
    prep = vl_preparer(cfg, model_dir)
    mi = image_input(cfg, TEXT, IMAGES)
    (got,) = ours(model, prep, [mi], lora=bank.batch([1]))
    (base,) = ours(model, prep, [mi])
    if cfg.family.moe:  # PEFT cannot target fused expert parameters: merge into transformers instead
        from tests.vision.oracle import merged_logits

        ref = merged_logits(shared_hf(model_dir), cfg, adapter, hf_inputs(cfg, model_dir, mi))[0]
    else:
        hf = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "a")
        with torch.no_grad():
            ref = hf(**hf_inputs(cfg, model_dir, mi)).logits[0]
    assert (got - base).abs().max().item() > 1e-2
    vl_tolerance(cfg).check(got, ref, "LoRA logits with images")


def sft_image_datums(cfg, seed: int) -> list[types.Datum]:
    """Next-token datums whose inputs hold images; targets on the text after each image."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for images in ([(40, 24, seed)], [(24, 32, seed + 1), (16, 16, seed + 2)]):
        text = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 5, 4)[: len(images) + 1]]
        mi = image_input(cfg, text, images)
        n = mi.length
        targets = torch.randint(3, 300, (n,), generator=g)
        weights = torch.rand(n, generator=g)
        out.append(types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": targets, "weights": weights}))
    return out


def reference_grads(model_dir, cfg, weights, datums, tmp_path):
    """Loss and per-target LoRA gradients [layers, …] from transformers + PEFT loading our export (dense),
    or autograd through transformers with the adapter merged into its weights (MoE: PEFT cannot target
    the fused expert parameters)."""
    from peft import PeftModel

    from tests.vision.oracle import DECODER, merged_logits

    moe = cfg.family.moe
    if moe:
        hf = shared_hf(model_dir)
        ref = type(weights)({t: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
                             for t, (a, b) in weights.weights.items()}, weights.rank, weights.alpha)
    else:
        save_peft(weights, tmp_path / "ref", str(model_dir), cfg)
        pm = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "ref", is_trainable=True)
    total = 0.0
    for d in datums:
        inputs = hf_inputs(cfg, model_dir, d.model_input)
        logits = merged_logits(hf, cfg, ref, inputs)[0] if moe else pm(**inputs).logits[0]
        lp = torch.log_softmax(logits, -1).gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
        loss = -(d.loss_fn_inputs["weights"].to_torch() * lp).sum()
        loss.backward()
        total += loss.item()
    if moe:
        return total, {t: (a.grad, b.grad) for t, (a, b) in ref.weights.items()}
    params = dict(pm.named_parameters())

    def grad(t: str, which: str) -> torch.Tensor:
        if t == "lm_head":
            return params[f"base_model.model.lm_head.lora_{which}.default.weight"].grad[None]
        block = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        return torch.stack([params[f"base_model.model.{DECODER}.{i}.{block}.{t}.lora_{which}.default.weight"].grad
                            for i in range(cfg.num_layers)])

    return total, {t: (grad(t, "A"), grad(t, "B")) for t in weights.weights}


def test_training_grads_with_images_match_transformers_peft(vl, tmp_path):
    model_dir, model = vl
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    trainer = Trainer(model, residency, base_model="tiny-vl")
    trainer.prep.images = ImageProcessing.for_model(cfg.vision, model_dir)
    weights = random_adapter(cfg, rank=4, seed=5)
    adapter = residency.install(weights, trainable=True)
    other = residency.install(random_adapter(cfg, rank=2, seed=6), trainable=True)  # fused with a text-only adapter
    datums = sft_image_datums(cfg, seed=1)
    text = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4})]
    outs = trainer.run([TrainRequest(adapter.id, datums, "cross_entropy"), TrainRequest(other.id, text, "cross_entropy")])
    assert not isinstance(outs[0], Exception), outs[0]
    total, ref = reference_grads(model_dir, cfg, weights, datums, tmp_path)
    tol = vl_tolerance(cfg)
    tol.check_scalar(outs[0].metrics["loss:sum"], total, sum(d.model_input.length for d in datums))
    assert set(adapter.grads) == set(weights.weights)
    for t, (gA, gB) in adapter.grads.items():
        tol.check_rel(gA, ref[t][0], (t, "A"))
        tol.check_rel(gB, ref[t][1], (t, "B"))
    assert all(p.grad is None for p in model.parameters())  # the tower and the base stay frozen


def test_the_job_parser_reads_image_chunks_and_refuses_bad_ones(vl_dir, tmp_path):
    cfg = ModelConfig.from_hf_dir(vl_dir)
    prep = vl_preparer(cfg, vl_dir)
    v = cfg.vision
    p = prep.prompt(image_input(cfg, [[5], [6]], [(40, 24, 1)]))
    assert p.tokens == (5, v.vision_start_token_id, *[v.image_token_id] * 15, v.vision_end_token_id, 6)
    assert [(im.start, im.tokens, im.grid) for im in p.images.images] == [(2, 15, (1, 6, 10))]
    params = types.SamplingParams(max_tokens=2)

    def refused(chunks, match, error=EngineError):
        with pytest.raises(error, match=match):
            prep.sample(None, types.ModelInput(chunks=chunks), 1, params)

    text = types.EncodedTextChunk(tokens=[5, 6])
    refused([text, image_chunk(40, 24, 1, expected_tokens=14)], r"prompt\.chunks\[1\]\.expected_tokens: 14, but "
            r"this 40×24 image is 15 tokens")
    refused([text, types.ImageChunk(data=b"not a png", format="png")], r"prompt\.chunks\[1\]: the bytes are not a "
            "readable png image")
    refused([text, types.ImageChunk(data=png(8, 8, 1), format="jpeg")], r"prompt\.chunks\[1\]: .*not a readable jpeg")
    refused([types.ImageAssetPointerChunk(format="png", location="https://example.com/x.png")],
            r"prompt\.chunks\[0\]: image_asset_pointer chunks are not supported", NotSupportedError)
    refused([types.EncodedTextChunk(tokens=[5, v.image_token_id])], "is the image placeholder")
    with pytest.raises(EngineError, match="is the image placeholder"):
        prep.sample(None, [5, v.image_token_id], 1, params)
    with pytest.raises(EngineError, match=r"datums\[0\]\.model_input\.chunks\[1\]\.expected_tokens"):
        prep.train([types.Datum(model_input=types.ModelInput(chunks=[text, image_chunk(40, 24, 1, expected_tokens=3)]),
                                loss_fn_inputs={"target_tokens": [1] * 5})], "cross_entropy", None)
    # a base that reads tokens only refuses image chunks by name
    text_prep = preparer(cfg)
    with pytest.raises(NotSupportedError, match=r"prompt\.chunks\[1\]: image chunks need a vision-language base"):
        text_prep.sample(None, types.ModelInput(chunks=[text, image_chunk(40, 24, 1)]), 1, params)


def test_prompt_images_identity_is_content_and_place():
    from mint_server.model.images import ImageInput

    def im(start, digest):
        return ImageInput(start=start, grid=(1, 2, 2), merge=2, patches=np.zeros((4, 1), np.float32), digest=digest)

    assert PromptImages((im(1, "a"),)) == PromptImages((im(1, "a"),))
    assert len({PromptImages((im(1, "a"),)), PromptImages((im(1, "a"),))}) == 1
    assert PromptImages((im(1, "a"),)) != PromptImages((im(1, "b"),))  # other bytes
    assert PromptImages((im(1, "a"),)) != PromptImages((im(2, "a"),))  # same bytes elsewhere


def test_plan_counts_the_tower_and_the_30b_a3b_shape(vl_dir):
    """`mint plan` counts the tower exactly (its parameters against transformers') and plans Qwen3-VL-30B-A3B."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from mint_server.cli import app

    hf = shared_hf(vl_dir)
    assert ModelConfig.from_hf_dir(vl_dir).vision.num_params() == sum(p.numel() for p in hf.model.visual.parameters())
    config = Path(__file__).resolve().parents[2] / "docs" / "configs" / "qwen3-vl-30b-a3b.json"
    out = CliRunner().invoke(app, ["plan", "--config", str(config), "--gpus", "1", "--gpu-mem", "80", "--rank", "32",
                                   "--json"])
    assert out.exit_code == 0, out.output
    p = json.loads(out.output)
    assert 3.0e10 < sum(p["params"].values()) < 3.2e10  # a 31 B model
    assert 4e8 < p["params"]["vision_tower"] < 7e8
    assert p["kv_bytes_per_token_full"] == 48 * 2 * 4 * 128 * 2


def test_tensor_parallel_and_batch_invariant_mode_refuse_vision_bases_by_name(vl_dir):
    from mint_server.model.invariant import InvariantBackendError, enable_for_model
    from mint_server.model.tp import TPNotSupportedError, check_supported

    cfg = ModelConfig.from_hf_dir(vl_dir)
    check_supported(cfg, 1)
    with pytest.raises(TPNotSupportedError, match=r"Qwen3VLForConditionalGeneration \(image input\)"):
        check_supported(cfg, 2)
    with pytest.raises(InvariantBackendError, match="Qwen3VLForConditionalGeneration is not supported"):
        enable_for_model(cfg, max_rank=8)
