"""Trainer state: AdamW vs torch, save → load → continue, PEFT export/import, interpolation."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tinker import types
from transformers import AutoModelForCausalLM

from mint_server.engine.interface import EngineError
from mint_server.engine.optim import adamw_step
from mint_server.engine.values import AdamState
from mint_server.model.loader import load_model
from mint_server.model.peft_io import load_peft
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.engine.test_training import install_random, sft_datums

ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def model(train_llama_dir):
    return load_model(train_llama_dir, device="cpu")


def new_trainer(model, max_rank=16) -> Trainer:
    residency = AdapterRegistry(model.config, num_slots=6, max_rank=max_rank, device="cpu", dtype=torch.float32)
    return Trainer(model, residency, base_model="tiny")


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_adamw_matches_torch(clip):
    g = torch.Generator().manual_seed(0)
    params = {"q_proj": (torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 4, generator=g))}
    ref = [params["q_proj"][0].clone().requires_grad_(), params["q_proj"][1].clone().requires_grad_()]
    hp = types.AdamParams(learning_rate=3e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=clip)
    opt = torch.optim.AdamW(ref, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=False)
    state = AdamState()
    for _ in range(4):
        grads = {"q_proj": (torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 4, generator=g))}
        adamw_step(params, grads, state, hp)
        ref[0].grad, ref[1].grad = grads["q_proj"][0].clone(), grads["q_proj"][1].clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref, clip, foreach=False)
        opt.step()
    if clip:  # the global norm is summed in a different order: equal to rounding
        torch.testing.assert_close(params["q_proj"][0], ref[0].detach(), rtol=1e-6, atol=1e-7)
    else:  # same arithmetic in the same order
        assert torch.equal(params["q_proj"][0], ref[0].detach()) and torch.equal(params["q_proj"][1], ref[1].detach())
    assert state.step == 4


def _train(trainer, aid, datums, steps):
    for _ in range(steps):
        trainer.run([TrainRequest(aid, datums, "cross_entropy")])
        trainer.optim_step(aid, ADAM)


def _weights(trainer, aid):
    return trainer.residency.weights(aid).weights


def test_save_load_continue_is_bitwise_identical(model, tmp_path):
    datums = sft_datums([13, 8, 17], seed=1)
    first = new_trainer(model)
    aid = first.create_adapter(types.LoraConfig(rank=8, seed=0))
    _train(first, aid, datums, 2)
    first.save_state(aid, tmp_path / "state", include_optimizer=True)
    meta = json.loads((tmp_path / "state" / "state.json").read_text())
    assert meta["step"] == 2 and meta["rank"] == 8 and meta["has_optimizer"]
    _train(first, aid, datums, 3)  # uninterrupted

    resumed = new_trainer(model)
    resumed.create_adapter(types.LoraConfig(rank=4, seed=9))  # a different slot than before
    rid = resumed.load_state(None, tmp_path / "state", include_optimizer=True)
    assert resumed.residency.get(rid).optim.step == 2 and resumed.residency.get(rid).trainable
    _train(resumed, rid, datums, 3)
    w1, w2 = _weights(first, aid), _weights(resumed, rid)
    assert w1.keys() == w2.keys()
    for t in w1:
        assert torch.equal(w1[t][0], w2[t][0]) and torch.equal(w1[t][1], w2[t][1]), t
    m1, m2 = first.residency.get(aid).optim.moments, resumed.residency.get(rid).optim.moments
    for t in m1:
        assert all(torch.equal(x, y) for x, y in zip(m1[t], m2[t], strict=True))


def test_load_state_into_an_adapter_and_errors(model, tmp_path):
    tr = new_trainer(model)
    aid = tr.create_adapter(types.LoraConfig(rank=8, seed=0))
    _train(tr, aid, sft_datums([9], seed=2), 1)
    tr.save_state(aid, tmp_path / "with-optim")
    tr.save_state(aid, tmp_path / "weights-only", include_optimizer=False)
    assert not (tmp_path / "weights-only" / "optimizer.safetensors").exists()

    other = tr.create_adapter(types.LoraConfig(rank=8, seed=5))
    tr.run([TrainRequest(other, sft_datums([5], seed=3), "cross_entropy")])  # pending grads get dropped
    assert tr.load_state(other, tmp_path / "weights-only", include_optimizer=False) == other
    o = tr.residency.get(other)
    assert o.grads == {} and o.optim.step == 0
    for t, (A, B) in _weights(tr, aid).items():
        assert torch.equal(A, _weights(tr, other)[t][0]) and torch.equal(B, _weights(tr, other)[t][1])

    small = tr.create_adapter(types.LoraConfig(rank=4, seed=0))
    with pytest.raises(EngineError, match="do not fit adapter"):
        tr.load_state(small, tmp_path / "with-optim")
    with pytest.raises(EngineError, match="saved without optimizer state"):
        tr.load_state(None, tmp_path / "weights-only", include_optimizer=True)
    with pytest.raises(EngineError, match="is not a training-state dir"):
        tr.load_state(None, tmp_path / "nowhere")
    alien = Trainer(model, AdapterRegistry(model.config, 2, 16, "cpu", torch.float32), base_model="other-model")
    with pytest.raises(EngineError, match="trained on base model 'tiny'"):
        alien.load_state(None, tmp_path / "with-optim")


def test_peft_export_loads_in_peft_and_import_round_trips(model, train_llama_dir, tmp_path):
    from peft import PeftModel

    tr = new_trainer(model)
    aid = tr.create_adapter(types.LoraConfig(rank=8, seed=0, train_mlp=False))
    _train(tr, aid, sft_datums([11, 6], seed=4), 2)  # B is nonzero after training
    tr.export_peft(aid, tmp_path / "peft")
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]

    tokens = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(5))
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(train_llama_dir, dtype=torch.float32),
                                   tmp_path / "peft")
    with torch.no_grad():
        ref = hf(tokens).logits
        slot = tr.residency.get(aid).slot
        ours = model(tokens, lora=tr.residency.bank.batch([slot, slot]))
        base = model(tokens)
    assert (ours - base).abs().max() > 1e-3
    assert (ours - ref).abs().max() <= 1e-4

    imported = tr.residency.install(load_peft(tmp_path / "peft", model.config), trainable=False).id
    tr.export_peft(imported, tmp_path / "again")  # export → read → export is bit-exact
    a, b = load_file(tmp_path / "peft" / "adapter_model.safetensors"), load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _delta(tr, aid):
    """ΔW per target and layer: scale · B @ A."""
    a = tr.residency.get(aid)
    return {t: a.scale * (B @ A) for t, (A, B) in _weights(tr, aid).items()}


def test_interpolation_is_exact_and_bounded_by_max_rank(model):
    tr = new_trainer(model, max_rank=16)
    a1, _ = install_random(tr, rank=4, seed=1, alpha=8.0)
    a2, _ = install_random(tr, rank=6, seed=2, alpha=24.0)
    d1, d2 = _delta(tr, a1.id), _delta(tr, a2.id)

    same = tr.interpolate([a1.id, a2.id], [1.0, 0.0])
    assert tr.residency.get(same).rank == 4 and not tr.residency.get(same).trainable
    for t, d in _delta(tr, same).items():
        torch.testing.assert_close(d, d1[t], rtol=0, atol=1e-7)

    avg = tr.interpolate([a1.id, a2.id], [0.5, 0.5])
    assert tr.residency.get(avg).rank == 10
    for t, d in _delta(tr, avg).items():
        torch.testing.assert_close(d, 0.5 * d1[t] + 0.5 * d2[t], rtol=1e-6, atol=1e-7)
    tokens = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():  # the same model function as merging both deltas by hand
        bank = tr.residency.bank
        ours = model(tokens, lora=bank.batch([tr.residency.get(avg).slot]))
        w = {t: (torch.cat([_weights(tr, a1.id)[t][0], _weights(tr, a2.id)[t][0]], 1),
                 torch.cat([0.5 * a1.scale * _weights(tr, a1.id)[t][1], 0.5 * a2.scale * _weights(tr, a2.id)[t][1]], 2))
             for t in d1}
        bank.write(5, w, 10, 10.0)
        torch.testing.assert_close(ours, model(tokens, lora=bank.batch([5])), rtol=1e-5, atol=1e-5)

    big, _ = install_random(tr, rank=12, seed=3)
    assert tr.residency.get(tr.interpolate([a1.id, big.id], [0.5, 0.5])).rank == 16  # exactly the max: fine
    with pytest.raises(EngineError, match="would have rank 18"):
        tr.interpolate([a2.id, big.id], [0.5, 0.5])
    with pytest.raises(EngineError, match="coefficients: 1 given for 2 adapters"):
        tr.interpolate([a1.id, a2.id], [1.0])
    with pytest.raises(EngineError, match="not a finite number"):
        tr.interpolate([a1.id, a2.id], [1.0, float("nan")])
