"""Qwen3-MoE in our model code vs the transformers oracle: base, expert LoRA, gradients, mixed batches."""

import pytest
import torch
from tinker import types

from mint_server.model import kernels
from mint_server.model import lora as lora_mod
from mint_server.model.config import ModelConfig
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, EXPERT_TARGETS, LoraBank, LoraBatch
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf, merged_logits
from tests.tolerance import for_model


@pytest.fixture(params=["gathered", "per_group", "grouped_mm", "grouped_wide"])
def expert_path(request, monkeypatch):
    """Run expert LoRA through add_lora's expert paths: one gathered bmm, the (expert, adapter)
    segments as one matmul per group or as one torch._grouped_mm (forced on CPU; the base expert
    products follow the same switch), or every adapter's A/B of an expert side by side in one
    grouped product ("grouped_wide")."""
    if request.param != "gathered":
        monkeypatch.setattr(lora_mod, "EXPERT_GATHER_LIMIT", 0)
    monkeypatch.setattr(lora_mod, "EXPERT_WIDE_FLOPS", float("inf") if request.param == "grouped_wide" else 0.0)
    devices = {"gathered": kernels.grouped_devices(), "per_group": (), "grouped_mm": ("cpu",),
               "grouped_wide": ("cpu",)}[request.param]
    with kernels.use_grouped_devices(devices):
        yield request.param


def tokens_of(seed, rows, length, vocab=320):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_sparse_layer_switches():
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 6, "num_attention_heads": 2, "moe_intermediate_size": 4, "num_local_experts": 4,
            "num_experts_per_tok": 2}
    cfg = ModelConfig.from_hf_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.num_experts == 4 and cfg.sparse_layers == (1, 5) and cfg.dense_layers == (0, 2, 3, 4)
    assert ModelConfig.from_hf_dict(base).sparse_layers == tuple(range(6))


@pytest.mark.parametrize("fixture", ["moe_dir", "moe_fused_dir", "moe_mixed_dir"])
def test_base_logits_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    tokens = tokens_of(1, 3, 37)
    with torch.no_grad():
        for_model(model.config).check(model(tokens), load_hf(model_dir)(tokens).logits, "logits vs transformers")


@pytest.mark.parametrize("fixture", ["moe_dir", "moe_mixed_dir"])
def test_expert_lora_logits_match_merged_transformers(fixture, request, expert_path):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    adapter = random_adapter(cfg, rank=4, seed=3)
    assert set(EXPERT_TARGETS) <= set(adapter.weights)
    bank = LoraBank(cfg, num_slots=3, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(1, adapter.weights, adapter.rank, adapter.alpha)
    tokens = tokens_of(2, 2, 29)
    hf = load_hf(model_dir)
    with torch.no_grad():
        ours = model(tokens, lora=bank.batch([1, 1]))
        ref = merged_logits(hf, cfg, adapter, tokens)
        base = model(tokens)
        # experts alone make a difference too
        experts_only = random_adapter(cfg, rank=4, seed=3, targets=EXPERT_TARGETS)
        bank.write(2, experts_only.weights, 4, adapter.alpha)
        ours_e = model(tokens, lora=bank.batch([2, 2]))
        ref_e = merged_logits(hf, cfg, experts_only, tokens)
    assert (ours - base).abs().max().item() > 1e-2
    assert (ours_e - base).abs().max().item() > 1e-3
    for_model(cfg).check(ours, ref, "expert LoRA logits")
    for_model(cfg).check(ours_e, ref_e, "experts-only LoRA logits")


def test_mixed_batch_of_four_adapters_and_base_rows_equals_each_alone(moe_dir, expert_path):
    model = load_model(moe_dir, device="cpu")
    bank = LoraBank(model.config, num_slots=6, max_rank=8, device="cpu", dtype=torch.float32)
    for slot, rank in zip([0, 1, 3, 5], [2, 8, 4, 1], strict=True):
        bank.write(slot, random_adapter(model.config, rank, seed=slot).weights, rank, alpha=8.0)
    row_slots = [3, -1, 0, 5, 1, 3, -1, 0]
    tokens = tokens_of(4, len(row_slots), 21)
    with torch.no_grad():
        mixed = model(tokens, lora=bank.batch(row_slots))
        for i, slot in enumerate(row_slots):
            alone = model(tokens[i : i + 1], lora=bank.batch([slot]))
            for_model(model.config).check(mixed[i], alone[0], (i, slot))
    assert (mixed[0] - mixed[2]).abs().max().item() > 1e-3


def sft_datums(lengths, seed, vocab=320):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        seq = torch.randint(3, vocab, (n + 1,), generator=g)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": seq[1:], "weights": torch.rand(n, generator=g)}))
    return out


def test_training_grads_match_autograd_through_merged_transformers(moe_dir, expert_path):
    model = load_model(moe_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    trainer = Trainer(model, residency, base_model="tiny-moe")
    weights = random_adapter(cfg, rank=4, seed=5)
    adapter = residency.install(weights, trainable=True)
    other = residency.install(random_adapter(cfg, rank=2, seed=6), trainable=True)  # fused with another adapter
    datums = sft_datums([17, 9, 23], seed=1)
    outs = trainer.run([TrainRequest(adapter.id, datums, "cross_entropy"),
                        TrainRequest(other.id, sft_datums([11], seed=2), "cross_entropy")])
    assert not isinstance(outs[0], Exception), outs[0]

    hf = load_hf(moe_dir)
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
    assert all(p.grad is None for p in model.parameters())  # router and experts stay frozen


def test_train_mlp_switch_covers_the_experts(moe_dir):
    model = load_model(moe_dir, device="cpu")
    trainer = Trainer(model, AdapterRegistry(model.config, 3, 8, "cpu", torch.float32), base_model="tiny-moe")
    with_mlp = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1)))
    assert set(with_mlp.targets) == set(lora_mod.target_layers(model.config))  # no dense MLP layers here
    assert set(with_mlp.targets) <= set(ALL_TARGETS) - {"gate_proj", "up_proj", "down_proj"}
    no_mlp = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1, train_mlp=False)))
    assert not set(no_mlp.targets) & set(EXPERT_TARGETS)
    A, B = trainer.residency.weights(with_mlp.id).weights["expert_gate_proj"]
    assert A.shape == (2, 8, 4, 64) and B.shape == (2, 8, 32, 4) and not B.any()


def test_expert_lora_batch_shapes_reach_add_lora(moe_dir):
    """A LoraBatch over the bank slices each layer's [n, E, r, in] expert stack (no copies)."""
    model = load_model(moe_dir, device="cpu")
    bank = LoraBank(model.config, num_slots=2, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(0, random_adapter(model.config, 2, seed=1).weights, 2, 4.0)
    batch: LoraBatch = bank.batch([0])
    A, B = batch.weights["expert_down_proj"]
    assert A[:, 1].shape == (2, 8, 2, 32) and B[:, 1].shape == (2, 8, 64, 2)
    assert A.data_ptr() == bank.A["expert_down_proj"].data_ptr()
