"""The Trainer on tiny random checkpoints (fp32, CPU): gradient parity with transformers + PEFT,
fused multi-adapter isolation, micro-batching, reverse KL, learning, and refusal of bad input."""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker import types
from transformers import AutoModelForCausalLM

from mint_server.engine import training
from mint_server.engine.interface import EngineError
from mint_server.engine.losses import ReverseKLDatum
from mint_server.model import invariant
from mint_server.model.loader import load_model
from mint_server.model.lora import ATTN_TARGETS, UNEMBED_TARGET, LoraBatch
from mint_server.model.peft_io import save_peft
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.model.test_parity import random_adapter
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import for_model

ADAM = types.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture(scope="module")
def model(train_llama_dir):
    return load_model(train_llama_dir, device="cpu")


def new_trainer(model, **kw) -> Trainer:
    residency = AdapterRegistry(model.config, num_slots=6, max_rank=16, device="cpu", dtype=torch.float32)
    return Trainer(model, residency, base_model="tiny", **kw)


@pytest.fixture
def trainer(model):
    return new_trainer(model)


def sft_datums(lengths, seed, vocab=320, weights="random"):
    """Next-token datums of the given model-input lengths: input seq[:-1], targets seq[1:]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        seq = torch.randint(3, vocab, (n + 1,), generator=g)
        w = torch.rand(n, generator=g) if weights == "random" else torch.ones(n)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": seq[1:], "weights": w}))
    return out


def install_random(trainer, rank=4, seed=3, alpha=16.0, trainable=True):
    """An adapter with random nonzero A and B (PEFT's zero-B init would make A's gradient zero)."""
    w = random_adapter(trainer.model.config, rank, seed)
    w.alpha = alpha
    return trainer.residency.install(w, trainable=trainable), w


def peft_reference(model_dir, adapter_dir, datums):
    """Loss, per-datum logprobs and LoRA grads from transformers + PEFT, one datum at a time."""
    from peft import PeftModel

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True)
    total, logprobs = 0.0, []
    for d in datums:
        tokens = torch.tensor([d.model_input.to_ints()])
        lp = torch.log_softmax(pm(input_ids=tokens).logits[0].float(), -1)
        lp = lp.gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
        loss = -(d.loss_fn_inputs["weights"].to_torch() * lp).sum()
        loss.backward()
        total += loss.item()
        logprobs.append(lp.detach())
    params = dict(pm.named_parameters())
    return total, logprobs, params


def peft_grad(params, target, layer, which):
    if target == UNEMBED_TARGET:
        name = f"base_model.model.lm_head.lora_{which}.default.weight"
    else:
        block = "self_attn" if target in ATTN_TARGETS else "mlp"
        name = f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.default.weight"
    return params[name].grad


def tol(model_or_trainer):
    """The tolerance policy (tests/tolerance.py) for the tiny model a test trains."""
    return for_model(getattr(model_or_trainer, "model", model_or_trainer).config)


@pytest.mark.parametrize("fixture", ["train_llama_dir", "train_qwen3_dir"])
def test_cross_entropy_grads_match_peft(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    trainer = new_trainer(load_model(model_dir, device="cpu"))
    adapter, weights = install_random(trainer)
    save_peft(weights, tmp_path / "peft", base_model=str(model_dir))
    datums = sft_datums([17, 9, 23], seed=1)  # unequal lengths: exercises right-padding

    (out,) = trainer.run([TrainRequest(adapter.id, datums, "cross_entropy")])
    ref_loss, ref_lp, params = peft_reference(model_dir, tmp_path / "peft", datums)

    assert out.loss_fn_output_type == "ArrayRecord"
    tol(trainer).check_scalar(out.metrics["loss:sum"], ref_loss, sum(d.model_input.length for d in datums))
    for o, lp in zip(out.loss_fn_outputs, ref_lp, strict=True):
        tol(trainer).check(o["logprobs"].to_torch(), lp, "logprobs vs PEFT")
        assert o["elementwise_loss"].shape == o["logprobs"].shape
    assert set(adapter.grads) == set(weights.weights)
    for t, (gA, gB) in adapter.grads.items():
        for layer in range(gA.shape[0]):
            tol(trainer).check_rel(gA[layer], peft_grad(params, t, layer, "A"), (t, layer, "A"))
            tol(trainer).check_rel(gB[layer], peft_grad(params, t, layer, "B"), (t, layer, "B"))


def test_gradients_accumulate_and_optim_step_clears_them(trainer):
    adapter, _ = install_random(trainer)
    d1, d2 = sft_datums([11], seed=1), sft_datums([7], seed=2)
    trainer.run([TrainRequest(adapter.id, d1, "cross_entropy")])
    g1 = {t: (a.clone(), b.clone()) for t, (a, b) in adapter.grads.items()}
    trainer.run([TrainRequest(adapter.id, d2, "cross_entropy")])
    fresh, _ = install_random(trainer)
    trainer.run([TrainRequest(fresh.id, d2, "cross_entropy")])
    for t, (a, b) in adapter.grads.items():
        torch.testing.assert_close(a, g1[t][0] + fresh.grads[t][0])
        torch.testing.assert_close(b, g1[t][1] + fresh.grads[t][1])
    before = trainer.residency.weights(adapter.id).weights["q_proj"][1].clone()
    resp = trainer.optim_step(adapter.id, ADAM)
    assert resp.metrics["grad_norm:mean"] > 0 and adapter.grads == {} and adapter.optim.step == 1
    assert not torch.equal(trainer.residency.weights(adapter.id).weights["q_proj"][1], before)


def test_forward_gives_logprobs_without_touching_gradients(trainer, model):
    adapter, _ = install_random(trainer)
    datums = sft_datums([13, 5], seed=4)
    fb, fwd, base = trainer.run([
        TrainRequest(adapter.id, datums, "cross_entropy"),
        TrainRequest(adapter.id, datums, "cross_entropy", backward=False),
        TrainRequest(None, datums, "cross_entropy", backward=False),
    ])
    grads = {t: (a.clone(), b.clone()) for t, (a, b) in adapter.grads.items()}
    for a, b in zip(fb.loss_fn_outputs, fwd.loss_fn_outputs, strict=True):
        tol(trainer).check(a["logprobs"].to_torch(), b["logprobs"].to_torch(), "forward vs forward_backward")
    tol(trainer).check_scalar(fwd.metrics["loss:sum"], fb.metrics["loss:sum"], sum(d.model_input.length for d in datums))
    for d, o in zip(datums, base.loss_fn_outputs, strict=True):  # bare base = model with no LoRA
        with torch.no_grad():
            logits = model(torch.tensor([d.model_input.to_ints()]))[0]
        lp = torch.log_softmax(logits, -1).gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
        tol(model).check(o["logprobs"].to_torch(), lp, "bare base")
    for t, (a, b) in adapter.grads.items():
        assert torch.equal(a, grads[t][0]) and torch.equal(b, grads[t][1])


def test_two_dimensional_targets_give_per_column_logprobs(trainer):
    adapter, _ = install_random(trainer)
    (d,) = sft_datums([8], seed=6, weights="ones")
    tokens = d.loss_fn_inputs["target_tokens"].to_torch()
    other = (tokens * 7 + 1) % 320
    two = types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": torch.stack([tokens, other], 1), "weights": torch.ones(8, 2)})
    alt = types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": other, "weights": torch.ones(8)})
    out2, out1 = trainer.run([TrainRequest(adapter.id, [two], "cross_entropy", backward=False),
                              TrainRequest(adapter.id, [d, alt], "cross_entropy", backward=False)])
    lp2 = out2.loss_fn_outputs[0]["logprobs"].to_torch()
    assert list(lp2.shape) == [8, 2]
    tol(trainer).check(lp2[:, 0], out1.loss_fn_outputs[0]["logprobs"].to_torch(), "column 0")
    tol(trainer).check(lp2[:, 1], out1.loss_fn_outputs[1]["logprobs"].to_torch(), "column 1")
    tol(trainer).check_scalar(out2.metrics["loss:sum"], out1.metrics["loss:sum"], 16)


def test_fused_step_isolates_adapters(model):
    """A fused pass over A and B updates A exactly as training A alone; C, not in the batch, is untouched."""
    fused, alone = new_trainer(model), new_trainer(model)
    a = fused.create_adapter(types.LoraConfig(rank=4, seed=1))
    b = fused.create_adapter(types.LoraConfig(rank=8, seed=2, train_unembed=False))
    c = fused.create_adapter(types.LoraConfig(rank=4, seed=3))
    a_alone = alone.create_adapter(types.LoraConfig(rank=4, seed=1))
    c_before = fused.residency.weights(c)
    da, db = sft_datums([15, 6], seed=7), sft_datums([19, 12, 4], seed=8)
    for _ in range(3):
        ra, rb = fused.run([TrainRequest(a, da, "cross_entropy"), TrainRequest(b, db, "cross_entropy")])
        (ra_alone,) = alone.run([TrainRequest(a_alone, da, "cross_entropy")])
        tol(model).check_scalar(ra.metrics["loss:sum"], ra_alone.metrics["loss:sum"], 21)
        for t, (gA, gB) in fused.residency.get(a).grads.items():
            ref = alone.residency.get(a_alone).grads[t]
            tol(model).check_rel(gA, ref[0], (t, "A"))
            tol(model).check_rel(gB, ref[1], (t, "B"))
        for tr, aid in ((fused, a), (fused, b), (alone, a_alone)):
            tr.optim_step(aid, ADAM)
    wa, wa_alone = fused.residency.weights(a).weights, alone.residency.weights(a_alone).weights
    for t in wa:
        # Adam's normalised step is ~lr per element whatever the gradient's rounding: the weights
        # agree to lr times the gradients' relative bound.
        tol(model).check(wa[t][0], wa_alone[t][0], (t, "A"))
        tol(model).check(wa[t][1], wa_alone[t][1], (t, "B"))
    for t, (A, B) in fused.residency.weights(c).weights.items():
        assert torch.equal(A, c_before.weights[t][0]) and torch.equal(B, c_before.weights[t][1])
    assert fused.residency.get(c).grads == {} and fused.residency.get(c).optim.step == 0


def test_micro_batches_and_checkpointing_give_the_same_gradients(model):
    plain = new_trainer(model)
    # the padded path's micro-batches (the packed path's: tests/engine/test_packing.py)
    split = new_trainer(model, max_tokens_per_pass=40, checkpoint_from_tokens=1, logits_chunk=320 * 8, pack=False)
    datums = sft_datums([21, 14, 9, 3, 17], seed=9)
    calls = []
    split_once = split._micro_batch
    split._micro_batch = lambda mb, *a: calls.append(len(mb)) or split_once(mb, *a)
    outs, ids = [], []
    for tr in (plain, split):
        aid = tr.create_adapter(types.LoraConfig(rank=4, seed=5))
        tr.run([TrainRequest(aid, datums, "cross_entropy")])
        tr.optim_step(aid, ADAM)  # B is nonzero now, so A gets a gradient too
        outs.append(tr.run([TrainRequest(aid, datums, "cross_entropy")])[0])
        ids.append(aid)
    assert calls == [1, 2, 2] * 2  # [21], [17, 14], [9, 3] under a budget of 40 padded tokens
    for x, y in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs, strict=True):
        tol(model).check(x["logprobs"].to_torch(), y["logprobs"].to_torch(), "micro-batched logprobs")
    ga, gb = plain.residency.get(ids[0]).grads, split.residency.get(ids[1]).grads
    for t in ga:
        tol(model).check_rel(gb[t][0], ga[t][0], (t, "A"))
        tol(model).check_rel(gb[t][1], ga[t][1], (t, "B"))



def test_fused_pass_under_a_memory_budget_is_exact(model, monkeypatch):
    """One fused pass of three adapters (importance sampling, GRPO's loss) recomputes blocks and
    chunks its logits because it is bigger than any of its requests alone (fusing never raises the
    peak), with no threshold set, and gives the losses and gradients of each request run alone."""
    plain = new_trainer(model, checkpoint_from_tokens=None)
    lengths = [13, 9, 11, 6]
    # 3 adapters × 39 tokens = 117 fused (156 padded: 3 × 4 rows × 13); each request alone holds 39 (52 padded)
    chunk = 12 * 320 * 3
    budget = new_trainer(model, checkpoint_from_tokens=None, logits_chunk=chunk)
    g = torch.Generator().manual_seed(4)
    reqs = []
    for k in range(3):
        reqs.append([types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": -3 * torch.rand(d.model_input.length, generator=g),
            "advantages": torch.randn(d.model_input.length, generator=g)}) for d in sft_datums(lengths, seed=20 + k)])
    checkpointed = []
    hidden_states, packed = model.hidden_states, model.packed_hidden_states
    monkeypatch.setattr(model, "hidden_states",
                        lambda *a, **kw: checkpointed.append(kw.get("recomputed_blocks")) or hidden_states(*a, **kw))
    monkeypatch.setattr(model, "packed_hidden_states",
                        lambda *a, **kw: checkpointed.append(kw.get("recomputed_blocks")) or packed(*a, **kw))
    results = []
    for tr in (plain, budget):
        ids = [tr.create_adapter(types.LoraConfig(rank=4, seed=k)) for k in range(3)]
        for aid, datums in zip(ids, reqs, strict=True):  # a step, so B is nonzero and A gets a gradient
            tr.run([TrainRequest(aid, datums, "cross_entropy")])
            tr.optim_step(aid, ADAM)
        jobs = [TrainRequest(aid, datums, "importance_sampling") for aid, datums in zip(ids, reqs, strict=True)]
        outs = [tr.run([job])[0] for job in jobs] if tr is plain else tr.run(jobs)
        results.append((outs, [tr.residency.get(aid).grads for aid in ids]))
    # 2 blocks: keeping even one block's activations of 156 tokens is more than 2 blocks' of 52
    assert checkpointed[-1] == 2 and not any(checkpointed[: len(checkpointed) // 2 + 1])
    vocab = model.config.vocab_size
    assert budget.memory_plan(156, 52) == (2, min(chunk, 52 * vocab)) and budget.memory_plan(52, 52) == (0, chunk)
    threshold = new_trainer(model, checkpoint_from_tokens=100)  # a request alone recomputes past its threshold
    assert threshold.memory_plan(156, 156)[0] == 1 and threshold.memory_plan(13, 13)[0] == 0
    (outs_a, grads_a), (outs_b, grads_b) = results
    for oa, ob in zip(outs_a, outs_b, strict=True):
        tol(model).check_scalar(oa.metrics["loss:sum"], ob.metrics["loss:sum"], sum(lengths))
        for x, y in zip(oa.loss_fn_outputs, ob.loss_fn_outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                tol(model).check(x[key].to_torch(), y[key].to_torch(), key)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert set(ga) == set(gb)
        for t in ga:
            tol(model).check_rel(gb[t][0], ga[t][0], (t, "A"))
            tol(model).check_rel(gb[t][1], ga[t][1], (t, "B"))


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """A 4-layer tiny Llama: recomputing one, half or all of the blocks are distinct plans."""
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("deep-llama"), "llama", tie=False, layers=4),
                      device="cpu")


def test_memory_plan_recomputes_the_fewest_first_blocks_within_the_budget(deep_model):
    """A micro-batch of T padded tokens over a budget of B recomputes k = ceil((1 − B/T)·L) blocks: the
    fewest that leave it keeping at most L·B block-tokens of activations; fused beyond its largest
    request, at most what that request keeps alone (except in batch-invariant mode)."""
    L = deep_model.config.num_layers
    assert L == 4
    for B in (1, 7, 100):
        tr = new_trainer(deep_model, checkpoint_from_tokens=B)
        for T in range(1, 4 * L * B + 2):
            k = tr.memory_plan(T, T)[0]
            assert 0 <= k <= L and (L - k) * T <= L * B, (B, T, k)
            assert k == 0 or (L - k + 1) * T > L * B, (B, T, k)  # one block fewer would be over
            assert k == math.ceil((1 - B / T) * L) if T > B else k == 0
    tr = new_trainer(deep_model, checkpoint_from_tokens=100)
    assert [tr.memory_plan(T, T)[0] for T in (100, 101, 200, 399, 401)] == [0, 1, 2, 3, 4]
    assert new_trainer(deep_model, checkpoint_from_tokens=1).memory_plan(64, 64)[0] == L
    never = new_trainer(deep_model, checkpoint_from_tokens=None)
    assert never.memory_plan(10**6, 10**6)[0] == 0
    # fused: 300 tokens keep 1 block (300 ≤ 4 × 100 block-tokens, what the 100-token request keeps)
    assert never.memory_plan(300, 100)[0] == 3 and never.memory_plan(500, 100)[0] == 4
    # a request alone over the budget: 200 tokens keep 2 blocks (400); fused 400 tokens keep 1
    assert tr.memory_plan(400, 200)[0] == 3 and tr.memory_plan(1000, 200)[0] == 4
    with invariant.use(True):  # a request's gradients must not depend on what it was fused with
        assert never.memory_plan(300, 100)[0] == 0 and tr.memory_plan(400, 200)[0] == 3


def test_recomputing_the_first_k_blocks_gives_the_same_gradients(deep_model):
    """k in {0, 1, L/2, L} (the budget chosen to give k): the first k blocks run twice (counted on the
    real forward), the rest once, and the logprobs and gradients are those of k = 0."""
    L = deep_model.config.num_layers
    datums = sft_datums([21, 14, 9, 3, 17], seed=9)
    padded = sum(d.model_input.length for d in datums)  # the tokens the (packed) pass computes
    calls = [0] * L

    def count(layer: int):
        return lambda module, args: calls.__setitem__(layer, calls[layer] + 1)

    hooks = [block.register_forward_pre_hook(count(i)) for i, block in enumerate(deep_model.layers)]
    results = []
    try:
        for k in (0, 1, L // 2, L):
            budget = max(1, math.ceil((L - k) * padded / L))  # the smallest budget that keeps L − k blocks
            tr = new_trainer(deep_model, checkpoint_from_tokens=budget)
            assert tr.memory_plan(padded, padded)[0] == k
            aid = tr.create_adapter(types.LoraConfig(rank=4, seed=5))
            tr.run([TrainRequest(aid, datums, "cross_entropy")])
            tr.optim_step(aid, ADAM)  # B is nonzero now, so A gets a gradient too
            calls[:] = [0] * L
            out = tr.run([TrainRequest(aid, datums, "cross_entropy")])[0]
            assert calls == [2] * k + [1] * (L - k), (k, calls)
            results.append((out, tr.residency.get(aid).grads))
    finally:
        for h in hooks:
            h.remove()
    (out0, g0), *rest = results
    for out, g in rest:
        for x, y in zip(out0.loss_fn_outputs, out.loss_fn_outputs, strict=True):
            tol(deep_model).check(y["logprobs"].to_torch(), x["logprobs"].to_torch(), "logprobs")
        for t in g0:
            tol(deep_model).check_rel(g[t][0], g0[t][0], (t, "A"))
            tol(deep_model).check_rel(g[t][1], g0[t][1], (t, "B"))


@pytest.mark.parametrize("lengths, sizes", [([21, 14], [7, 7, 7]), ([22, 15], [8, 7, 7])])
def test_logits_chunks_are_even_and_the_last_is_not_recomputed(model, monkeypatch, lengths, sizes):
    """Logits over 8 positions at a time: T = 21 or 22 positions run as three chunks of sizes within one
    (not 8, 8, 5 / 8, 8, 6); in backward only the first two build their logits again (the last's
    backward runs right after the forward). Gradients equal the unchunked pass's."""
    rows = len(lengths)
    datums = sft_datums(lengths, seed=11)
    calls: list[tuple[int, ...]] = []  # each call's chunk, by its row-0 targets
    block = training.logprobs_block

    def counted(model_, h, targets, lora):
        calls.append(tuple(targets[0, :, 0].tolist()))
        return block(model_, h, targets, lora)

    grads = []
    for chunk in (None, rows * model.config.vocab_size * 8):
        # the padded path's chunks over rows × positions (the packed path's: tests/engine/test_packing.py)
        tr = new_trainer(model, checkpoint_from_tokens=None, pack=False,
                         **({} if chunk is None else {"logits_chunk": chunk}))
        aid = tr.create_adapter(types.LoraConfig(rank=4, seed=5))
        tr.run([TrainRequest(aid, datums, "cross_entropy")])
        tr.optim_step(aid, ADAM)
        if chunk is not None:
            monkeypatch.setattr(training, "logprobs_block", counted)
        tr.run([TrainRequest(aid, datums, "cross_entropy")])
        grads.append(tr.residency.get(aid).grads)
    forward, backward = calls[: len(sizes)], calls[len(sizes) :]  # the backward starts after the whole forward
    assert [len(c) for c in forward] == sizes
    assert sorted(backward) == sorted(forward[:-1])  # every chunk but the last, once
    for t in grads[0]:
        tol(model).check_rel(grads[1][t][0], grads[0][t][0], (t, "A"))
        tol(model).check_rel(grads[1][t][1], grads[0][t][1], (t, "B"))


def test_sft_learns_a_small_task(trainer):
    aid = trainer.create_adapter(types.LoraConfig(rank=8, seed=0))
    datums = sft_datums([16, 16, 12, 20], seed=10, weights="ones")
    losses = []
    for _ in range(20):
        (out,) = trainer.run([TrainRequest(aid, datums, "cross_entropy")])
        losses.append(out.metrics["loss:sum"])
        trainer.optim_step(aid, types.AdamParams(learning_rate=1e-2))
    assert losses[-1] <= 0.5 * losses[0], losses


@pytest.mark.slow
def test_sft_learns_on_smollm2(smollm2_dir):
    model = load_model(smollm2_dir, device="cpu")
    tr = new_trainer(model)
    aid = tr.create_adapter(types.LoraConfig(rank=16, seed=0))
    datums = sft_datums([32] * 4, seed=11, vocab=model.config.vocab_size, weights="ones")
    losses = []
    for _ in range(12):
        (out,) = tr.run([TrainRequest(aid, datums, "cross_entropy")])
        losses.append(out.metrics["loss:sum"])
        tr.optim_step(aid, types.AdamParams(learning_rate=2e-3))
    assert losses[-1] <= 0.5 * losses[0], losses


def _reverse_kl_reference(trainer, student, reference, rows, temperature):
    """Per datum, no padding: Σ_t w_t Σ_v p_s (log p_s − log p_r) with right-aligned inputs."""
    model, bank = trainer.model, trainer.residency.bank
    total, per_datum = 0.0, []
    for s_tok, r_tok, w in rows:
        with torch.no_grad():
            lora_r = bank.batch([reference.slot]) if reference is not None else None
            ref_logits = model(torch.tensor([r_tok]), lora=lora_r)[0][len(r_tok) - len(s_tok):]
        lora, leaves = stacked_training_batch(trainer.residency, [student], [0])
        s_lp = torch.log_softmax(model(torch.tensor([s_tok]), lora=lora)[0] / temperature, -1)
        r_lp = torch.log_softmax(ref_logits / temperature, -1)
        kl = (s_lp.exp() * (s_lp - r_lp)).sum(-1) * torch.tensor(w)
        kl.sum().backward()
        for t, (A, B) in leaves[student.id].items():
            per_datum.append((t, A.grad, B.grad))
        total += kl.sum().item()
    grads = {}
    for t, gA, gB in per_datum:
        old = grads.get(t)
        grads[t] = (gA, gB) if old is None else (old[0] + gA, old[1] + gB)
    return total, grads


@pytest.mark.parametrize("with_reference_adapter", [False, True])
def test_reverse_kl_matches_direct_computation(trainer, with_reference_adapter):
    student, _ = install_random(trainer, seed=3)
    reference = install_random(trainer, seed=4, trainable=False)[0] if with_reference_adapter else None
    g = torch.Generator().manual_seed(12)
    rows = []
    for n, prefix in ((9, 4), (14, 0), (6, 2)):
        s_tok = torch.randint(3, 320, (n,), generator=g).tolist()
        r_tok = torch.randint(3, 320, (prefix,), generator=g).tolist() + s_tok  # privileged prefix
        rows.append((s_tok, r_tok, torch.rand(n, generator=g).tolist()))
    datums = [ReverseKLDatum(types.ModelInput.from_ints(s), types.ModelInput.from_ints(r),
                             types.TensorData(data=s[1:] + [5], dtype="int64", shape=[len(s)]), w)
              for s, r, w in rows]
    out = trainer.reverse_kl(student.id, reference.id if reference else None, datums, temperature=0.7)
    ref_total, ref_grads = _reverse_kl_reference(trainer, student, reference, rows, 0.7)
    tol(trainer).check_scalar(out.metrics["loss:sum"], ref_total, 29)
    assert [o["loss"].shape for o in out.loss_fn_outputs] == [[9], [14], [6]]
    assert all(np.all(o["loss"].to_numpy() >= -tol(trainer).rel) for o in out.loss_fn_outputs)
    for t, (gA, gB) in student.grads.items():
        tol(trainer).check_rel(gA, ref_grads[t][0], (t, "A"))
        tol(trainer).check_rel(gB, ref_grads[t][1], (t, "B"))


def test_reverse_kl_against_itself_is_zero_and_checks_input(trainer):
    student, _ = install_random(trainer, seed=3)
    d = ReverseKLDatum(types.ModelInput.from_ints([5, 6, 7, 8]), types.ModelInput.from_ints([5, 6, 7, 8]),
                       [6, 7, 8, 9], [1.0] * 4)
    clone = trainer.residency.install(trainer.residency.weights(student.id), trainable=False)
    out = trainer.reverse_kl(student.id, clone.id, [d])
    assert abs(out.metrics["loss:sum"]) < 1e-5
    assert all(g.abs().max() < 1e-6 for pair in student.grads.values() for g in pair)
    short = ReverseKLDatum(types.ModelInput.from_ints([5, 6, 7, 8]), types.ModelInput.from_ints([7, 8]),
                           [6, 7, 8, 9], [1.0, 0.0, 1.0, 1.0])
    with pytest.raises(EngineError, match=r"datums\[0\]\.weights: nonzero on student positions 0\.\.1"):
        trainer.reverse_kl(student.id, None, [short])
    with pytest.raises(EngineError, match="temperature"):
        trainer.reverse_kl(student.id, None, [d], temperature=0.0)
    with pytest.raises(EngineError, match="datums: empty batch"):
        trainer.reverse_kl(student.id, None, [])


def snapshot(trainer, aid):
    a = trainer.residency.get(aid)
    return ({t: (x.clone(), y.clone()) for t, (x, y) in trainer.residency.weights(aid).weights.items()},
            {t: (x.clone(), y.clone()) for t, (x, y) in a.grads.items()}, a.optim.step)


def assert_same(s1, s2):
    (w1, g1, step1), (w2, g2, step2) = s1, s2
    assert step1 == step2 and w1.keys() == w2.keys() and g1.keys() == g2.keys()
    for d1, d2 in ((w1, w2), (g1, g2)):
        for t in d1:
            assert torch.equal(d1[t][0], d2[t][0]) and torch.equal(d1[t][1], d2[t][1])


def _req(aid, loss="cross_entropy", backward=True, **inputs):
    base = {"target_tokens": [3, 4, 5], "weights": [1.0, 1.0, 1.0]}
    inputs = {**base, **inputs} if loss == "cross_entropy" else inputs
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)
    return TrainRequest(aid, [datum], loss, None, backward)


def test_bad_requests_fail_alone_and_leave_state_unchanged(trainer):
    aid, _ = install_random(trainer)
    aid = aid.id
    sampler, _ = install_random(trainer, trainable=False)
    trainer.run([_req(aid)])
    before = snapshot(trainer, aid)
    rl = {"target_tokens": [3, 4, 5], "logprobs": [-1.0, -1.0, -1.0]}
    bad = [
        (_req(aid, loss="nope"), "loss_fn: unknown loss function 'nope'"),
        (_req(aid, loss="ppo", **rl), r"loss_fn_inputs\.advantages is required"),
        (_req(aid, loss="ppo", advantages=[1.0, float("nan"), 0.0], **rl), "advantages: contains NaN or inf"),
        (_req(aid, weights=[1.0, float("inf"), 0.0]), "weights: contains NaN or inf"),
        (_req(aid, target_tokens=[3, 4, 320]), "token id 320 is outside the vocabulary"),
        (_req(aid, target_tokens=[3, 4]), "does not match the model_input length 3"),
        (TrainRequest(aid, [], "cross_entropy"), "datums: empty batch"),
        (_req(None), "adapter_id: forward_backward needs an adapter"),
        (_req(sampler.id), "is sampler-only, not trainable"),
        (_req("a999-nope"), "unknown adapter id"),
        (TrainRequest(aid, [types.Datum(model_input=types.ModelInput.from_ints([1, 400]),
                                        loss_fn_inputs={"target_tokens": [1, 2]})], "cross_entropy"),
         r"model_input: token id 400"),
        (_req(aid, loss="dro", advantages=[1.0, 1.0, 1.0], **rl), r"loss_fn_config\.beta is required"),
        # the ratio overflows: exp(−1 + 1e4) = inf; caught after backward, before anything is committed
        (_req(aid, loss="importance_sampling", target_tokens=[3, 4, 5], logprobs=[-1e4, -1.0, -1.0],
              advantages=[1.0, 1.0, 1.0]), "non-finite gradients"),
    ]
    state_checks = ("non-finite", "needs an adapter", "sampler-only", "unknown adapter")  # checked when run
    for req, match in bad:
        if not any(c in match for c in state_checks):  # parse errors: refused before anything is queued
            with pytest.raises(EngineError, match=match):
                trainer.validate(req)
        (result,) = trainer.run([req])
        assert isinstance(result, EngineError) and re.search(match, str(result)), (match, result)
        assert_same(snapshot(trainer, aid), before)
    # mixed with good requests, only the bad ones fail
    good = _req(aid)
    results = trainer.run([bad[0][0], good, bad[2][0], _req(aid, backward=False)])
    assert isinstance(results[0], EngineError) and isinstance(results[2], EngineError)
    assert isinstance(results[1], types.ForwardBackwardOutput) and isinstance(results[3], types.ForwardBackwardOutput)
    with pytest.raises(EngineError, match=r"adam_params\.learning_rate"):
        trainer.optim_step(aid, types.AdamParams(learning_rate=float("nan")))
    with pytest.raises(EngineError, match=r"adam_params\.beta2"):
        trainer.optim_step(aid, types.AdamParams(beta2=1.0))
    with pytest.raises(EngineError, match="sampler-only"):
        trainer.optim_step(sampler.id, ADAM)


def test_bf16_bank_keeps_fp32_masters(train_llama_dir, tmp_path):
    model = load_model(train_llama_dir, device="cpu", dtype=torch.bfloat16)
    residency = AdapterRegistry(model.config, num_slots=2, max_rank=8, device="cpu", dtype=torch.bfloat16)
    trainer = Trainer(model, residency, base_model="tiny")
    aid = trainer.create_adapter(types.LoraConfig(rank=4, seed=0))
    datums = sft_datums([10, 6], seed=13)
    for _ in range(3):
        trainer.run([TrainRequest(aid, datums, "cross_entropy")])
        trainer.optim_step(aid, types.AdamParams(learning_rate=1e-4))
    a = residency.get(aid)
    master = a.master  # the masters the optimizer stepped (engine/masters.py)
    assert master is not None
    bank_B = residency.bank.B["q_proj"][a.slot, :, :, :4]
    assert master["q_proj"][1].dtype == torch.float32
    assert torch.equal(master["q_proj"][1].to(torch.bfloat16), bank_B)
    assert not torch.equal(master["q_proj"][1], bank_B.float())  # updates below bf16 resolution are kept
    trainer.save_state(aid, tmp_path / "state")
    other = Trainer(model, AdapterRegistry(model.config, 2, 8, "cpu", torch.bfloat16), base_model="tiny")
    bid = other.load_state(None, tmp_path / "state")
    loaded = other.residency.get(bid).master
    assert loaded is not None and torch.equal(loaded["q_proj"][1], master["q_proj"][1])


def test_stable_reinforce_uses_the_samplers_records(model):
    """Provenance-only datums train exactly like datums carrying the recorded logprobs themselves."""
    from mint_server.engine.records import SamplingRecord, SamplingRecords

    records = SamplingRecords()
    prompt, sampled = [5, 6, 7, 8], [9, 10, 11]
    recorded = np.array([-0.7, -1.9, -0.2], dtype=np.float32)
    records.put("seq-1", SamplingRecord(np.array(prompt, np.int32), np.array(sampled, np.int32), recorded, None))
    tokens = prompt + sampled[:-1]
    adv = [0.0] * 3 + [1.5] * 3
    by_id = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": prompt[1:] + sampled, "advantages": adv}).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="seq-1", length=4),
                     types.SampledProvenanceSpan(sequence_id="seq-1", length=2)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="seq-1", offset=1, length=3),
                        types.SampledProvenanceSpan(sequence_id="seq-1", length=3)])
    explicit = types.Datum(model_input=by_id.model_input, loss_fn_inputs={
        **by_id.loss_fn_inputs, "logprobs": [0.0] * 3 + recorded.tolist()})
    grads = []
    for datum, recs in ((by_id, records), (explicit, None)):
        residency = AdapterRegistry(model.config, num_slots=2, max_rank=8, device="cpu", dtype=torch.float32)
        tr = Trainer(model, residency, base_model="tiny", records=recs)
        aid = tr.create_adapter(types.LoraConfig(rank=4, seed=0))
        tr.run([TrainRequest(aid, [datum], "stable_reinforce")])
        grads.append(residency.get(aid).grads)
    for t in grads[0]:
        assert torch.equal(grads[0][t][1], grads[1][t][1]) and grads[0][t][1].abs().max() > 0


def stacked_training_batch(residency, adapters, row_adapter):  # the simple [n, layers, …] reference
    """A LoraBatch whose A/B are fresh leaves viewing the bank, so backward yields per-adapter grads.

    row_adapter[i] indexes `adapters` (or -1 for base). Returns the batch and
    leaves[adapter_id][target] = (A_leaf, B_leaf) to read `.grad` from after backward.
    """
    rmax = max(a.rank for a in adapters)
    targets = sorted({t for a in adapters for t in a.targets})
    leaves: dict = {a.id: {} for a in adapters}
    weights = {}
    for t in targets:
        As, Bs = [], []
        for a in adapters:
            if t in a.targets:
                A = residency.bank.A[t][a.slot, :, : a.rank].detach().requires_grad_(True)
                B = residency.bank.B[t][a.slot, :, :, : a.rank].detach().requires_grad_(True)
                leaves[a.id][t] = (A, B)
            else:  # this adapter has no LoRA on t: zero weights, no grad wanted
                L, fi, fo = residency.bank.shapes[t]
                A = torch.zeros(L, a.rank, fi, device=residency.device, dtype=residency.dtype)
                B = torch.zeros(L, fo, a.rank, device=residency.device, dtype=residency.dtype)
            pad = rmax - a.rank
            As.append(F.pad(A, (0, 0, 0, pad)) if pad else A)
            Bs.append(F.pad(B, (0, pad)) if pad else B)
        weights[t] = (torch.stack(As), torch.stack(Bs))
    scale = torch.tensor([a.scale for a in adapters], device=residency.device, dtype=torch.float32)
    rows = torch.tensor(row_adapter, dtype=torch.long, device=residency.device)
    return LoraBatch(weights=weights, rows=rows, scale=scale), leaves


def test_a_pass_in_slices_lets_sampler_steps_run_between_with_the_same_gradients(model):
    """With sampling work waiting, forward_backward runs in micro-batch slices and calls back between
    them (the engine's sampler steps); losses and gradients equal the one-pass ones within 1e-6."""
    from mint_server.engine.sampling import Sampler
    from tests.engine.test_sampling import params

    whole, sliced = new_trainer(model), new_trainer(model)
    datums = sft_datums([30, 30, 30, 30, 20, 20, 10, 10], seed=21)
    sampler = Sampler(model, sliced.residency, kv_budget_tokens=512, max_seq_len=128)
    stream = sampler.submit(sliced.prep.sample(None, [5, 6, 7], 1, params(max_tokens=100)), None)
    steps_between: list[int] = []

    def between() -> None:
        sampler.step()
        steps_between.append(sampler.stats.decode_tokens)

    outs, ids = [], []
    for tr, cb in ((whole, None), (sliced, between)):
        aid = tr.create_adapter(types.LoraConfig(rank=4, seed=5))
        tr.run([TrainRequest(aid, datums, "cross_entropy")])
        tr.optim_step(aid, ADAM)
        job = tr.validate(TrainRequest(aid, datums, "cross_entropy"))
        outs.append(Trainer.__mro__[1].run(tr, [job], cb, slice_tokens=64)[0])
        ids.append(aid)
    # packed slices of ≤ 64 tokens, in request order: [30, 30], [30, 30], [20, 20, 10, 10]
    assert len(steps_between) == 2 and steps_between[-1] > steps_between[0]
    assert not stream.done()
    for x, y in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs, strict=True):
        assert float((x["logprobs"].to_torch() - y["logprobs"].to_torch()).abs().max()) <= 1e-6
    ga, gb = whole.residency.get(ids[0]).grads, sliced.residency.get(ids[1]).grads
    for t in ga:
        for i in (0, 1):
            assert float((gb[t][i] - ga[t][i]).abs().max()) <= 1e-6 * max(1.0, float(ga[t][i].abs().max()))


def test_a_step_with_non_finite_moments_is_rolled_back_exactly(trainer):
    """Gradients of 1e20 are finite, but their squares overflow Adam's second moment in float32: the
    step is refused and weights, moments and step count are bit-for-bit what they were."""
    adapter, _ = install_random(trainer)
    trainer.run([TrainRequest(adapter.id, sft_datums([9], seed=3), "cross_entropy")])
    trainer.optim_step(adapter.id, ADAM)  # moments exist now
    trainer.run([TrainRequest(adapter.id, sft_datums([9], seed=4), "cross_entropy")])
    for gA, gB in adapter.grads.values():
        gA.fill_(1e20)
        gB.fill_(1e20)
    weights = {t: (a.clone(), b.clone()) for t, (a, b) in trainer.residency.weights(adapter.id).weights.items()}
    moments = {t: tuple(m.clone() for m in ms) for t, ms in adapter.optim.moments.items()}
    with pytest.raises(EngineError, match="non-finite"):
        trainer.optim_step(adapter.id, types.AdamParams(learning_rate=1e-3))
    assert adapter.optim.step == 1 and adapter.grads
    for t, (a, b) in trainer.residency.weights(adapter.id).weights.items():
        assert torch.equal(a, weights[t][0]) and torch.equal(b, weights[t][1])
    for t, ms in adapter.optim.moments.items():
        assert all(torch.equal(m, m0) for m, m0 in zip(ms, moments[t], strict=True))
    with pytest.raises(EngineError, match=r"adam_params\.learning_rate.*\[0, 10\]"):
        trainer.optim_step(adapter.id, types.AdamParams(learning_rate=1e30))


def test_no_non_finite_adapter_is_written_or_read(tmp_path):
    from mint_server.model.config import ModelError
    from mint_server.model.peft_io import LoraWeights, load_peft

    A, B = torch.zeros(2, 2, 8), torch.zeros(2, 8, 2)
    B[1, 3, 0] = float("inf")
    with pytest.raises(ModelError, match="NaN or inf"):
        save_peft(LoraWeights({"q_proj": (A, B)}, rank=2), tmp_path / "bad", "tiny/llama")
    assert not (tmp_path / "bad").exists()
    save_peft(LoraWeights({"q_proj": (A, torch.zeros(2, 8, 2))}, rank=2), tmp_path / "good", "tiny/llama")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "good" / "adapter_model.safetensors"))
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "good" / "adapter_model.safetensors"))
    with pytest.raises(ModelError, match="NaN or inf"):
        load_peft(tmp_path / "good", 2)
