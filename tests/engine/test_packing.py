"""Training without padding: a pass's datums packed end to end (per-datum attention, positions
restarting, each token on its own datum's adapter) give the padded path's losses, logprobs and
gradients within the tolerance policy, for every built-in loss, fused adapters and the custom-loss
path; the memory rules count real tokens; families that cannot pack keep the padded path."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from mint_server.engine import training
from mint_server.engine.custom_loss import compile_loss
from mint_server.engine.losses import LOSSES
from mint_server.engine.training_lora import TokenLora
from mint_server.model import invariant
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.engine.test_training import ADAM, sft_datums
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import for_model

FAMILIES = ["llama", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    extra = {"num_hidden_layers": 2} if request.param == "qwen3_moe" else {}
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"pack-{request.param}"), request.param, tie=False, **extra)
    return load_model(path, device="cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("pack-llama"), "llama", tie=False), device="cpu")


def new_trainer(model, pack: bool, **kw) -> Trainer:
    residency = AdapterRegistry(model.config, num_slots=6, max_rank=16, device="cpu", dtype=torch.float32)
    return Trainer(model, residency, base_model="tiny", pack=pack, **kw)


def loss_datums(loss: str, lengths: list[int], seed: int) -> list[types.Datum]:
    """Datums carrying every input `loss` takes (random advantages, sampler logprobs, ratio masks)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d in sft_datums(lengths, seed=seed):
        n = d.model_input.length
        inputs = {"target_tokens": d.loss_fn_inputs["target_tokens"]}
        if loss == "cross_entropy":
            inputs["weights"] = d.loss_fn_inputs["weights"]
        else:
            inputs["advantages"] = torch.randn(n, generator=g)
            inputs["logprobs"] = -5.5 + 0.3 * torch.randn(n, generator=g)
        if loss == "gspo":
            inputs["sequence_ratio_mask"] = (torch.rand(n, generator=g) > 0.3).float()
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


CONFIG = {"dro": {"beta": 0.1}, "gspo": {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}}


def run_both(model, requests, backward=True, **kw):
    """requests: (adapter index, datums, loss) — run padded then packed on fresh trainers with the
    same adapters (one warm-up step each, so B is nonzero and A gets a gradient). → per trainer
    (outputs, grads per adapter, trainer)."""
    results = []
    for pack in (False, True):
        tr = new_trainer(model, pack, **kw)
        ids = [tr.create_adapter(types.LoraConfig(rank=r, seed=s, train_unembed=u))
               for r, s, u in ((4, 1, True), (8, 2, False), (4, 3, True))]
        for aid in ids:
            tr.run([TrainRequest(aid, sft_datums([7, 5], seed=40), "cross_entropy")])
            tr.optim_step(aid, ADAM)
        outs = tr.run([TrainRequest(None if a is None else ids[a], datums, loss, CONFIG.get(loss), backward)
                       for a, datums, loss in requests])
        results.append((outs, [tr.residency.get(aid).grads for aid in ids], tr))
    return results


def check_same(model, padded, packed):
    tol = for_model(model.config)
    for oa, ob in zip(padded[0], packed[0], strict=True):
        assert not isinstance(oa, Exception) and not isinstance(ob, Exception), (oa, ob)
        n = sum(len(x["logprobs"].data) for x in oa.loss_fn_outputs)
        tol.check_scalar(ob.metrics["loss:sum"], oa.metrics["loss:sum"], n)
        for x, y in zip(oa.loss_fn_outputs, ob.loss_fn_outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                assert x[key].shape == y[key].shape
                tol.check(y[key].to_torch(), x[key].to_torch(), key)
    for ga, gb in zip(padded[1], packed[1], strict=True):
        assert set(ga) == set(gb)
        for t in ga:
            tol.check_rel(gb[t][0], ga[t][0], (t, "A"))
            tol.check_rel(gb[t][1], ga[t][1], (t, "B"))


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_packed_fused_pass_equals_padded_for_every_loss(model, loss):
    """Three adapters (ranks 4, 8, 4; one without the unembedding) fused in one pass, datums of
    mixed lengths: packed and padded agree, and the packed pass computes no padding."""
    reqs = [(0, loss_datums(loss, [23, 4, 11], seed=1), loss), (1, loss_datums(loss, [2, 17], seed=2), loss),
            (2, loss_datums(loss, [9], seed=3), loss)]
    padded, packed = run_both(model, reqs)
    check_same(model, padded, packed)
    assert packed[2].stats["padding_tokens"] == 0 and packed[2].stats["padded_passes"] == 0
    assert padded[2].stats["padding_tokens"] > 0


def test_packed_under_memory_bounds_equals_padded(model):
    """Micro-batches, recomputed blocks and chunked logits (each chunk's tokens on their own
    adapters) on the packed path, against one unbounded padded pass."""
    reqs = [(0, loss_datums("ppo", [23, 4, 11], seed=4), "ppo"), (1, loss_datums("ppo", [2, 17, 8], seed=5), "ppo")]
    padded, _ = run_both(model, reqs, checkpoint_from_tokens=None)
    _, packed = run_both(model, reqs, max_tokens_per_pass=30, checkpoint_from_tokens=5,
                         logits_chunk=7 * model.config.vocab_size)
    check_same(model, padded, packed)


def test_forward_only_packs_adapters_and_base_rows(model):
    """A forward-only pass of two adapters and the bare base in one packed row."""
    reqs = [(0, loss_datums("cross_entropy", [13, 3], seed=6), "cross_entropy"),
            (None, loss_datums("cross_entropy", [6, 19], seed=7), "cross_entropy"),
            (1, loss_datums("cross_entropy", [8], seed=8), "cross_entropy")]
    padded, packed = run_both(model, reqs, backward=False)
    check_same(model, padded, packed)
    assert all(g == {} for g in packed[1])


def test_positions_restart_per_datum(llama, monkeypatch):
    """A datum packed after others gives the logprobs it gives trained alone: positions restart at 0
    (RoPE's positions, seen by the model) and it attends to nothing of its neighbours."""
    tr = new_trainer(llama, pack=True)
    aid = tr.create_adapter(types.LoraConfig(rank=4, seed=1))
    datums = loss_datums("cross_entropy", [17, 5, 12], seed=9)
    seen, rope = [], llama.rope
    monkeypatch.setattr(llama, "rope", lambda positions: seen.append(positions.tolist()) or rope(positions))
    (together,) = tr.run([TrainRequest(aid, datums, "cross_entropy", backward=False)])
    assert seen == [[list(range(17)) + list(range(5)) + list(range(12))]]
    for i, d in enumerate(datums):
        (alone,) = tr.run([TrainRequest(aid, [d], "cross_entropy", backward=False)])
        for key in ("logprobs", "elementwise_loss"):
            for_model(llama.config).check(together.loss_fn_outputs[i][key].to_torch(),
                                          alone.loss_fn_outputs[0][key].to_torch(), (i, key))


def test_two_dimensional_targets_pack(llama):
    """cross_entropy with [N, K] targets beside 1-D ones in one packed pass."""
    (d,) = sft_datums([8], seed=6, weights="ones")
    tokens = d.loss_fn_inputs["target_tokens"].to_torch()
    two = types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": torch.stack([tokens, (tokens * 7 + 1) % 320], 1), "weights": torch.rand(8, 2)})
    reqs = [(0, [two] + sft_datums([5, 11], seed=3), "cross_entropy"), (1, sft_datums([3], seed=4), "cross_entropy")]
    padded, packed = run_both(llama, reqs)
    check_same(llama, padded, packed)
    assert list(packed[0][0].loss_fn_outputs[0]["logprobs"].shape) == [8, 2]


def test_custom_loss_packs(llama):
    """A server-side custom loss (forward, then a weighted cross-entropy backward) on the packed path."""
    def loss(logprobs, advantages):
        return -(torch.exp(logprobs - logprobs.detach()) * advantages).sum() + 0.1 * (logprobs ** 2).sum(), {}

    handle = trace_loss(loss, {"logprobs": 1, "advantages": 1}, "s")
    compiled = compile_loss(handle.name, [(i.name, i.rank) for i in handle.inputs], encode_graph(handle).nodes)
    datums = loss_datums("ppo", [14, 3, 9], seed=10)
    results = []
    for pack in (False, True):
        tr = new_trainer(llama, pack)
        aid = tr.create_adapter(types.LoraConfig(rank=4, seed=1))
        tr.run([TrainRequest(aid, sft_datums([7, 5], seed=40), "cross_entropy")])
        tr.optim_step(aid, ADAM)
        out = tr.forward_backward_custom(tr.prep.custom(datums, compiled).on(aid))
        results.append((out, tr.residency.get(aid).grads, tr.stats["padding_tokens"]))
    (a, ga, pad_a), (b, gb, pad_b) = results
    tol = for_model(llama.config)
    tol.check_scalar(b.metrics["loss:sum"], a.metrics["loss:sum"], 26)
    for t in ga:
        tol.check_rel(gb[t][0], ga[t][0], (t, "A"))
        tol.check_rel(gb[t][1], ga[t][1], (t, "B"))
    assert pad_b == 0 < pad_a


def test_memory_rules_count_real_tokens(llama, monkeypatch):
    """Micro-batches, recomputation and logits chunks are planned from the datums' own tokens: one
    long datum beside short ones is its length plus theirs, not rows × the longest."""
    tr = new_trainer(llama, pack=True, max_tokens_per_pass=40, checkpoint_from_tokens=1000)
    aid = tr.create_adapter(types.LoraConfig(rank=4, seed=1))
    seen = []
    plan = tr.memory_plan
    monkeypatch.setattr(tr, "memory_plan", lambda tokens, alone: seen.append((tokens, alone)) or plan(tokens, alone))
    tr.run([TrainRequest(aid, sft_datums([30, 2, 3, 4, 25, 9], seed=11), "cross_entropy")])
    # request order, cut at 40 tokens: [30, 2, 3, 4] = 39, [25, 9] = 34; the request alone: 40 (its budget)
    assert seen == [(39, 40), (34, 40)]
    rows = [training.Row(0, i, n) for i, n in enumerate([30, 2, 3, 4, 25, 9])]
    assert [[r.length for r in mb] for mb in tr.plan_packed(rows, 40)] == [[30, 2, 3, 4], [25, 9]]
    assert [[r.length for r in mb] for mb in tr.plan_packed(rows, 20)] == [[30], [2, 3, 4], [25], [9]]
    assert tr.stats["padding_tokens"] == 0 and tr.stats["tokens"] == 73


def test_batch_invariant_mode_keeps_the_padded_path(llama, caplog):
    """Batch-invariant mode pads (its bitwise guarantee follows padded rows), said once in the log."""
    tr = new_trainer(llama, pack=True)
    aid = tr.create_adapter(types.LoraConfig(rank=4, seed=1))
    with invariant.use(True), caplog.at_level(logging.INFO, logger=training.__name__):
        for _ in range(2):
            tr.run([TrainRequest(aid, sft_datums([6, 2], seed=12), "cross_entropy")])
    assert tr.stats["padded_passes"] == 2 and tr.stats["packed_passes"] == 0 and tr.stats["padding_tokens"] == 8  # 2 passes × (6 + 6)
    assert sum("batch-invariant" in r.getMessage() for r in caplog.records) == 1


def test_families_that_cannot_pack_say_why(tmp_path):
    """The padded path's families: each has its reason (the dense and MoE families have none)."""
    from mint_server.model.transformer import Transformer

    class Other(Transformer):
        def run_layers(self, *a, **kw):  # a family whose blocks hand state along a row
            return super().run_layers(*a, **kw)

    cfg = load_model(make_tiny_checkpoint(tmp_path / "l", "llama", tie=False), device="cpu").config
    assert training.packing_unsupported(Transformer(cfg)) is None
    assert "Other" in training.packing_unsupported(Other(cfg))
    for arch, word in (("DeepseekV3ForCausalLM", "MLA"), ("Qwen3_5ForCausalLM", "hybrid"),
                       ("DeepseekV4ForCausalLM", "V4"), ("Qwen3VLForConditionalGeneration", "vision")):
        odd = Transformer(cfg)
        odd.config = dataclasses.replace(cfg, architecture=arch)  # the family registry's entry says why
        assert word in training.packing_unsupported(odd), arch


def test_token_lora_spans_follow_runs_of_adapters():
    lora = TokenLora(weights={}, rows=torch.tensor([0, 0, -1, 1, 1, 1, 0]), scale=torch.ones(2))
    assert lora.spans == [(0, 0, 2), (1, 3, 6), (0, 6, 7)]
    assert lora.window(2, 5).spans == [(1, 1, 3)]
    assert np.array_equal(lora.window(4, 7).rows.numpy(), [1, 1, 0])
