"""gpt-oss and GLM-5 in our model code vs the transformers oracle: base logits (and that the family's
special parts — sinks, sliding window, shared DSA selection — really act), LoRA on every target,
training gradients, mixed-adapter batches, PEFT export, and the features refused by name."""

import pytest
import torch
from tinker import types

from mint_server.model import invariant
from mint_server.model.config import ModelConfig, ModelError
from mint_server.model.loader import load_model
from mint_server.model.lora import (
    ATTN_TARGETS,
    EXPERT_TARGETS,
    MLP_TARGETS,
    SHARED_TARGETS,
    LoraBank,
    target_layers,
)
from mint_server.model.peft_io import load_peft, save_peft
from mint_server.model.tp import TPNotSupportedError, check_supported
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.families.helpers import merged_logits
from tests.mla.test_mla_model import tokens_of
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.moe.test_moe_model import sft_datums
from tests.tolerance import for_model

FIXTURES = ["gpt_oss_dir", "glm_dir"]


def test_config_reads_gpt_oss_fields(gpt_oss_dir):
    cfg = ModelConfig.from_hf_dir(gpt_oss_dir)
    assert cfg.architecture == "GptOssForCausalLM" and cfg.family.sinks and cfg.family.o_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention") and (cfg.window(0), cfg.window(1)) == (5, 0)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.sparse_layers == (0, 1) and not cfg.dense_layers
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 1.0) and cfg.rope_scaling["rope_type"] == "yarn"
    assert set(target_layers(cfg)) == {*ATTN_TARGETS, *EXPERT_TARGETS, "lm_head"}  # never the router or sinks


def test_config_reads_glm_fields(glm_dir):
    cfg = ModelConfig.from_hf_dir(glm_dir)
    m = cfg.mla
    assert cfg.architecture == "GlmMoeDsaForCausalLM" and m.dsa and m.index_rope_interleave and m.rope_interleave
    assert m.indexer_types == ("full", "shared", "full", "shared")
    assert [m.has_indexer(i) for i in range(4)] == [True, False, True, False]
    assert cfg.dense_layers == (0,) and cfg.sparse_layers == (1, 2, 3)
    base = {"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "moe_intermediate_size": 4, "num_hidden_layers": 5, "num_attention_heads": 2, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "kv_lora_rank": 4, "q_lora_rank": 4, "qk_rope_head_dim": 2,
            "qk_nope_head_dim": 2, "v_head_dim": 2, "index_topk": 2, "index_head_dim": 4, "index_n_heads": 2}
    # transformers' default schedule: every layer full; a pattern or freq / offset make some shared
    assert ModelConfig.from_hf_dict(base).mla.indexer_types == ("full",) * 5
    assert ModelConfig.from_hf_dict({**base, "index_topk_pattern": "FSSFS"}).mla.indexer_types == (
        "full", "shared", "shared", "full", "shared")
    assert ModelConfig.from_hf_dict({**base, "index_topk_freq": 2}).mla.indexer_types == (
        "full", "full", "shared", "full", "shared")
    with pytest.raises(ModelError, match="indexer_types"):
        ModelConfig.from_hf_dict({**base, "indexer_types": ["shared"] * 5})


@pytest.mark.parametrize("fixture", FIXTURES)
def test_base_logits_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    tokens = tokens_of(1, 3, 29)  # longer than gpt-oss's window of 5
    with torch.no_grad():
        for_model(model.config).check(model(tokens), load_hf(model_dir)(tokens).logits, "logits vs transformers")


def test_gpt_oss_sinks_and_sliding_window_act(gpt_oss_dir):
    """The parity above would not notice a family switch that does nothing: turning each off moves the logits."""
    model = load_model(gpt_oss_dir, device="cpu")
    tokens = tokens_of(2, 2, 17)
    attn = model.layers[0].self_attn
    with torch.no_grad():
        ref = model(tokens)
        attn.window = 0
        no_window = model(tokens)
        attn.window = 5
        sinks, attn.sinks = attn.sinks, None
        no_sinks = model(tokens)
        attn.sinks = sinks
    assert (no_window - ref)[:, 5:].abs().max().item() > 1e-3  # positions past the window
    for_model(model.config).check(no_window[:, :5], ref[:, :5], "inside the window")
    assert (no_sinks - ref).abs().max().item() > 1e-3


def test_glm_shared_layers_reuse_the_full_layers_selection(glm_dir):
    """A shared layer attends to the previous full layer's keys: handing it another selection (all keys)
    moves the logits, and its own indexer does not exist."""
    model = load_model(glm_dir, device="cpu")
    assert model.layers[1].self_attn.indexer is None and model.layers[2].self_attn.indexer is not None
    tokens = tokens_of(3, 2, 19)  # more keys than index_topk (6)
    causal = torch.ones(19, 19, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        ref = model(tokens)
        x = model.embed_tokens(tokens)
        cos, sin = model.rope(torch.arange(19).expand(2, 19))
        cos, sin = cos * model.rope_factor, sin * model.rope_factor
        for i, block in enumerate(model.layers):
            x, _ = block(x, cos, sin, None, None, causal if i % 2 else None)
        dense = model.logits(model.norm(x))
    assert (dense - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("fixture", FIXTURES)
def test_lora_on_every_target_matches_merged_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    adapter = random_adapter(cfg, rank=4, seed=3)
    assert set(adapter.weights) == set(target_layers(cfg))
    bank = LoraBank(cfg, num_slots=3, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(1, adapter.weights, adapter.rank, adapter.alpha)
    experts = random_adapter(cfg, rank=4, seed=4, targets=EXPERT_TARGETS)
    bank.write(2, experts.weights, experts.rank, experts.alpha)
    tokens = tokens_of(2, 2, 23)
    hf = load_hf(model_dir)
    with torch.no_grad():
        ours, ours_e, base = model(tokens, lora=bank.batch([1, 1])), model(tokens, lora=bank.batch([2, 2])), model(tokens)
        ref, ref_e = merged_logits(hf, cfg, adapter, tokens), merged_logits(hf, cfg, experts, tokens)
    assert (ours - base).abs().max().item() > 1e-2 and (ours_e - base).abs().max().item() > 1e-3
    for_model(cfg).check(ours, ref, "LoRA logits")
    for_model(cfg).check(ours_e, ref_e, "experts-only LoRA logits")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_training_grads_match_autograd_through_merged_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    trainer = Trainer(model, residency, base_model="tiny")
    weights = random_adapter(cfg, rank=4, seed=5)
    adapter = residency.install(weights, trainable=True)
    other = residency.install(random_adapter(cfg, rank=2, seed=6), trainable=True)  # fused with another adapter
    datums = sft_datums([17, 9, 21], seed=1)
    outs = trainer.run([TrainRequest(adapter.id, datums, "cross_entropy"),
                        TrainRequest(other.id, sft_datums([11], seed=2), "cross_entropy")])
    assert not isinstance(outs[0], Exception), outs[0]

    hf = load_hf(model_dir)
    hf.requires_grad_(False)
    ref = type(weights)({t: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
                         for t, (a, b) in weights.weights.items()}, weights.rank, weights.alpha)
    total = 0.0
    for d in datums:
        toks = torch.tensor([d.model_input.to_ints()])
        lp = torch.log_softmax(merged_logits(hf, cfg, ref, toks)[0], -1)
        lp = lp.gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
        loss = -(d.loss_fn_inputs["weights"].to_torch() * lp).sum()
        loss.backward()
        total += loss.item()
    for_model(cfg).check_scalar(outs[0].metrics["loss:sum"], total, sum(len(d.model_input.to_ints()) for d in datums))
    assert set(adapter.grads) == set(weights.weights)
    for t, (gA, gB) in adapter.grads.items():
        for_model(cfg).check_rel(gA, ref.weights[t][0].grad, (t, "A"))
        for_model(cfg).check_rel(gB, ref.weights[t][1].grad, (t, "B"))
    assert all(p.grad is None for p in model.parameters())  # base, router, sinks and indexers stay frozen


@pytest.mark.parametrize("fixture", FIXTURES)
def test_recomputed_blocks_give_the_same_gradients(fixture, request):
    """Activation checkpointing re-runs the first k blocks in backward (GLM-5: with the selection handed in
    again); none, some and all give the same gradients."""
    model = load_model(request.getfixturevalue(fixture), device="cpu")
    bank = LoraBank(model.config, num_slots=1, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(0, random_adapter(model.config, 4, seed=7).weights, 4, 8.0)
    tokens = tokens_of(4, 2, 15)
    grads = []
    for recomputed_blocks in (0, 1, model.config.num_layers):
        A = {t: a.requires_grad_(True) for t, a in bank.A.items()}
        lora = bank.batch([0, 0])
        loss = model.logits(model.hidden_states(tokens, lora=lora, recomputed_blocks=recomputed_blocks), lora).logsumexp(-1).sum()
        grads.append(torch.autograd.grad(loss, list(A.values())))
        for a in A.values():
            a.requires_grad_(False)
    for some in grads[1:]:
        for g0, g1 in zip(grads[0], some, strict=True):
            for_model(model.config).check_rel(g1, g0, "recomputed")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_mixed_batch_of_adapters_and_base_rows_equals_each_alone(fixture, request):
    model = load_model(request.getfixturevalue(fixture), device="cpu")
    bank = LoraBank(model.config, num_slots=6, max_rank=8, device="cpu", dtype=torch.float32)
    for slot, rank in zip([0, 1, 3, 5], [2, 8, 4, 1], strict=True):
        bank.write(slot, random_adapter(model.config, rank, seed=slot).weights, rank, alpha=8.0)
    row_slots = [3, -1, 0, 5, 1, 3, -1, 0]
    tokens = tokens_of(4, len(row_slots), 13)
    with torch.no_grad():
        mixed = model(tokens, lora=bank.batch(row_slots))
        for i, slot in enumerate(row_slots):
            alone = model(tokens[i : i + 1], lora=bank.batch([slot]))
            for_model(model.config).check(mixed[i], alone[0], (i, slot))
    assert (mixed[0] - mixed[2]).abs().max().item() > 1e-3


@pytest.mark.parametrize("fixture", FIXTURES)
def test_train_switches_never_target_router_sinks_or_indexer(fixture, request):
    model = load_model(request.getfixturevalue(fixture), device="cpu")
    trainer = Trainer(model, AdapterRegistry(model.config, 3, 8, "cpu", torch.float32), base_model="tiny")
    full = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1)))
    assert set(full.targets) == set(target_layers(model.config))
    attn = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1, train_mlp=False,
                                                                        train_unembed=False)))
    assert not set(attn.targets) & set(EXPERT_TARGETS) and "lm_head" not in attn.targets


@pytest.mark.parametrize("fixture", FIXTURES)
def test_peft_export_loads_in_transformers_and_peft(fixture, request, tmp_path):
    """Our PEFT dir loads into transformers + PEFT and gives our logits. GLM-5: attention, routed experts
    (per-expert layout: PEFT fuses them into transformers' expert stacks on load, as for any DeepSeek-style
    MoE) and lm_head; not the dense MLP and shared experts, which PEFT 0.21's fusion remaps by their
    names (gate/up/down_proj) onto the routed experts. gpt-oss: every target but the experts (PEFT has
    no per-expert form of gpt-oss's interleaved expert stack). docs/families.md. Either way the full
    adapter, experts packed, round-trips through our loader bit for bit."""
    from peft import PeftModel

    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    full = random_adapter(cfg, rank=4, seed=8)
    save_peft(full, tmp_path / "full", str(model_dir), cfg)
    back = load_peft(tmp_path / "full", cfg)
    assert all(torch.equal(back.weights[t][0], a) and torch.equal(back.weights[t][1], b)
               for t, (a, b) in full.weights.items())
    skip = EXPERT_TARGETS if cfg.family.name == "gpt_oss" else MLP_TARGETS + SHARED_TARGETS
    adapter = random_adapter(cfg, rank=4, seed=9, targets=[t for t in target_layers(cfg) if t not in skip])
    save_peft(adapter, tmp_path / "peft", str(model_dir), cfg, moe_layout="per-expert")
    bank = LoraBank(cfg, num_slots=1, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(0, adapter.weights, adapter.rank, adapter.alpha)
    tokens = tokens_of(5, 2, 21)
    hf = PeftModel.from_pretrained(load_hf(model_dir), tmp_path / "peft").eval()
    with torch.no_grad():
        ours, base, ref = model(tokens, lora=bank.batch([0, 0])), model(tokens), hf(tokens).logits
    assert (ours - base).abs().max().item() > 1e-2
    for_model(cfg).check(ours, ref, "LoRA logits vs transformers + PEFT")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_unsupported_modes_are_refused_by_name(fixture, request):
    cfg = ModelConfig.from_hf_dir(request.getfixturevalue(fixture))
    with pytest.raises(TPNotSupportedError, match=cfg.architecture):
        check_supported(cfg, 2)
    with pytest.raises(invariant.InvariantBackendError, match=cfg.architecture):
        invariant.enable_for_model(cfg, max_rank=8)
    assert not invariant.enabled()


def test_quantized_gpt_oss_reads_mxfp4_and_refuses_other_methods(gpt_oss_dir):
    """MXFP4 is read (dequantized at load: tests/model/test_prequantized.py); other methods are refused by name."""
    import json

    hf = json.loads((gpt_oss_dir / "config.json").read_text())
    assert ModelConfig.from_hf_dict({**hf, "quantization_config": {"quant_method": "mxfp4"}}).prequantized.method == "mxfp4"
    with pytest.raises(ModelError, match="quantization_config.quant_method 'gptq'"):
        ModelConfig.from_hf_dict({**hf, "quantization_config": {"quant_method": "gptq"}})
