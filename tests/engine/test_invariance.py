"""Batch-invariant mode (model/invariant.py): bitwise claims, asserted exactly on every machine.

Each test compares a row computed alone with the same row computed beside other work: other rows
on other adapters, a different step composition, the trainer instead of the sampler. Outside the
mode these agree only within the tolerance policy (tests/tolerance.py); inside it they are equal.
"""

import pytest
import torch
from tinker import types

from mint_server.model import invariant
from mint_server.model.config import ModelConfig
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry, TrainRequest, make_residency
from tests.engine.helpers import TrainerHarness as Trainer
from tests.engine.test_sampling import drain, make_sampler, prompt_of
from tests.engine.test_training import sft_datums
from tests.model.test_parity import mixed_batch, random_adapter


@pytest.fixture(autouse=True)
def invariant_mode():
    with invariant.use(True):
        yield


@pytest.fixture(scope="module", params=["sampling_llama_dir", "sampling_qwen3_dir"])
def model(request):
    m = load_model(request.getfixturevalue(request.param), device="cpu")
    with invariant.use(False):
        invariant.enable_for_model(m.config, max_rank=8)  # this machine's kernels pass the checks
    return m


def test_a_row_alone_equals_the_row_in_a_mixed_batch(model):
    bank, row_slots, tokens = mixed_batch(model)
    with torch.no_grad():
        mixed = model(tokens, lora=bank.batch(row_slots))
        for i, slot in enumerate(row_slots):
            assert torch.equal(mixed[i], model(tokens[i : i + 1], lora=bank.batch([slot]))[0]), (i, slot)
            # a shorter prefix of the row: the same logits at the positions they share
            assert torch.equal(mixed[i, :9], model(tokens[i : i + 1, :9], lora=bank.batch([slot]))[0]), (i, slot)
    assert (mixed[0] - mixed[2]).abs().max().item() > 1e-3  # distinct adapters really differ


def sample_alone_and_crowded(model, temperature: float):
    residency = make_residency(model.config, num_slots=8, max_rank=8)
    ids = [residency.install(random_adapter(model.config, r, seed=s), trainable=s == 1).id
           for r, s in ((4, 1), (8, 2), (2, 3), (1, 4))]
    prompt = prompt_of(7, 13)
    p = types.SamplingParams(stop=[], max_tokens=12, temperature=temperature, seed=5)
    alone_sampler = make_sampler(model, residency, kv_slots=64)
    alone = alone_sampler.submit(ids[0], prompt, 1, p)
    drain(alone_sampler)
    crowded_sampler = make_sampler(model, residency, kv_slots=512)
    # 63 co-tenant rows on other adapters and the base, other prompts and lengths, admitted first
    others = [crowded_sampler.submit(ids[1 + k % 3] if k % 4 else None, prompt_of(100 + k, 5 + k % 11), 1,
                                     types.SamplingParams(stop=[], max_tokens=4 + k % 9, temperature=1.0, seed=k))
              for k in range(63)]
    crowded_sampler.step()
    crowded = crowded_sampler.submit(ids[0], prompt, 1, p)
    drain(crowded_sampler)
    assert all(len(f.result().sequences[0].tokens) > 0 for f in others)
    return residency, ids[0], prompt, alone.result().sequences[0], crowded.result().sequences[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_and_logprobs_alone_equal_those_beside_63_co_tenants(model, temperature):
    _, _, _, alone, crowded = sample_alone_and_crowded(model, temperature)
    assert crowded.tokens == alone.tokens
    assert crowded.logprobs == alone.logprobs  # bitwise: float equality of every value


def test_sampled_logprobs_equal_the_training_forward_bitwise(model):
    """True on-policy: the trainer's forward over prompt + sample gives the sampler's logprobs."""
    residency, aid, prompt, _, seq = sample_alone_and_crowded(model, 1.0)
    trainer = Trainer(model, residency, base_model="tiny")
    tokens = prompt + seq.tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for backward in (False, True):
        (out,) = trainer.run([TrainRequest(aid, [datum], "cross_entropy", backward=backward)])
        assert not isinstance(out, Exception), out
        trained = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1 :].tolist()
        assert trained == seq.logprobs, backward  # the importance ratio is exactly 1


def test_a_policy_trained_beside_three_others_equals_it_alone(model):
    """A fused pass with three other policies (longer and shorter rows) gives the policy's logprobs,
    loss and gradients bitwise as a pass of its own."""
    def fresh():
        residency = AdapterRegistry(model.config, num_slots=6, max_rank=8, device="cpu", dtype=torch.float32)
        return Trainer(model, residency, base_model="tiny")

    alone, fused = fresh(), fresh()
    mine = sft_datums([17, 9, 23], seed=1)
    a_alone = alone.create_adapter(types.LoraConfig(rank=4, seed=1))
    a = fused.create_adapter(types.LoraConfig(rank=4, seed=1))
    others = [(fused.create_adapter(types.LoraConfig(rank=r, seed=10 + r)), sft_datums(lengths, seed=r))
              for r, lengths in ((2, [31, 5]), (8, [12]), (1, [40, 3, 8]))]
    for step in range(2):  # a step in between, so B is nonzero and A gets a gradient too
        (ra,) = alone.run([TrainRequest(a_alone, mine, "cross_entropy")])
        rf = fused.run([TrainRequest(a, mine, "cross_entropy")]
                       + [TrainRequest(o, d, "cross_entropy") for o, d in others])[0]
        assert rf.metrics["loss:sum"] == ra.metrics["loss:sum"], step
        for x, y in zip(rf.loss_fn_outputs, ra.loss_fn_outputs, strict=True):
            assert torch.equal(x["logprobs"].to_torch(), y["logprobs"].to_torch()), step
        ga, gf = alone.residency.get(a_alone).grads, fused.residency.get(a).grads
        assert set(ga) == set(gf)
        for t in ga:
            assert torch.equal(gf[t][0], ga[t][0]) and torch.equal(gf[t][1], ga[t][1]), (step, t)
        adam = types.AdamParams(learning_rate=1e-2)
        alone.optim_step(a_alone, adam)
        for aid in [a, *(o for o, _ in others)]:
            fused.optim_step(aid, adam)


def test_unsupported_families_are_refused_by_name():
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "moe_intermediate_size": 16, "num_local_experts": 4,
            "num_experts_per_tok": 2}
    with invariant.use(False):
        with pytest.raises(invariant.InvariantBackendError, match="Qwen3MoeForCausalLM"):
            invariant.enable_for_model(ModelConfig.from_hf_dict(base), max_rank=8)
        assert not invariant.enabled()
