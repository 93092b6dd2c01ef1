"""The Tinker protocol end to end: the real tinker SDK against a live server on the real engine."""

from __future__ import annotations

import io
import math
import tarfile

import httpx
import pytest
import tinker
import torch
from tinker import types

from tests.service.live import BASE, KEY_A, LR, LiveServer, batch, datum, train


def test_health_and_capabilities(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    caps = rest.get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [(BASE, 256)]


def test_training_loop(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    tc = client_a.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    info = tc.get_info()
    assert info.lora_rank == 8 and info.model_data.arch == "LlamaForCausalLM"
    assert tc.get_tokenizer().encode("hello")  # tokenizer_id is the model dir: it loads offline
    losses = train(tc, 8)
    assert losses[-1] < 0.8 * losses[0], losses

    out = tc.forward(batch(), "cross_entropy").result()
    lps = [o["logprobs"].tolist() for o in out.loss_fn_outputs]
    assert [len(lp) for lp in lps] == [7, 5]
    assert all(math.isfinite(x) and x <= 0 for lp in lps for x in lp)
    # Cross-entropy with unit weights: the summed loss is minus the summed target logprobs.
    assert out.metrics["loss:sum"] == pytest.approx(-sum(map(sum, lps)), rel=1e-5)
    assert out.metrics["loss:sum"] < 0.8 * losses[0]

    def custom(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
        return loss, {"custom:sum": float(loss.detach())}

    # forward_backward_custom: a forward, then a cross_entropy backward with weights = -dLoss/dlogprobs.
    custom_out = tc.forward_backward_custom(batch(), custom).result()
    assert custom_out.metrics["custom:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
    assert "surrogate_loss:sum" in custom_out.metrics
    # Its gradient is cross-entropy's here (weights are 1), so the step moves the model.
    assert tc.optim_step(types.AdamParams(learning_rate=LR)).result().metrics["grad_norm:mean"] > 0
    assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] != out.metrics["loss:sum"]


def test_checkpoints_sampling_and_rest(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4).result()
    train(tc, 2)
    state = tc.save_state("step-1").result()
    assert state.path == f"tinker://{tc.model_id}/weights/step-1"

    sampler = tc.save_weights_and_get_sampling_client().result()
    # stop=[] never stops at EOS, so every sample has exactly max_tokens tokens.
    res = sampler.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=3, stop=[])).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) == 3 for s in res.sequences)
    for s in res.sequences:
        assert s.sequence_id and s.logprobs is not None and all(0 <= t < server.engine.vocab_size for t in s.tokens)
        # The logprobs reported with a sample (temperature 1) are the model's: scoring the same
        # sequence gives the same numbers.
        scored = sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, *s.tokens])).result()
        assert scored[2:] == pytest.approx(s.logprobs, abs=1e-4)

    saved = tc.save_weights_for_sampler("s1").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/s1"
    sc = client_a.create_sampling_client(model_path=saved.path).result()
    assert sc.get_base_model() == BASE
    # The exported checkpoint holds the trained weights: its scores match the training client's.
    lp = sc.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
    trained = tc.forward([datum([1, 2, 3])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert lp[0] is None and lp[1:] == pytest.approx(trained, abs=1e-4)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints([9, 8, 7])
    assert sc.sample(prompt, 1, greedy).result().sequences[0].tokens == \
        sampler.sample(prompt, 1, greedy).result().sequences[0].tokens  # same weights, same greedy path

    # The base model sampled through the service is the engine's base model, sampled directly.
    base = client_a.create_sampling_client(base_model=BASE).result()
    own = server.engine.submit(server.engine.prepare_sample(None, [9, 8, 7], 1, greedy)).result().sequences[0].tokens
    assert base.sample(prompt, 1, greedy).result().sequences[0].tokens == list(own)

    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    runs = rest.list_training_runs().result()
    assert [r.training_run_id for r in runs.training_runs] == [tc.model_id]
    assert runs.training_runs[0].lora_rank == 4
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.checkpoint_id for c in ckpts} == {"weights/step-1", "sampler_weights/s1"}
    info = rest.get_weights_info_by_tinker_path(state.path).result()
    assert info.lora_rank == 4 and info.base_model == BASE

    # Archive: 302 to a signed URL that works without the key; it holds a PEFT adapter that peft
    # loads onto the HF model.
    r = httpx.get(
        f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/sampler_weights/s1/archive",
        headers={"X-API-Key": KEY_A},
    )
    assert r.status_code == 302
    archive = httpx.get(r.headers["Location"], timeout=60)
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/gzip"
    peft_dir = server.settings.data_dir / "unpacked"
    with tarfile.open(fileobj=io.BytesIO(archive.content), mode="r:gz") as tar:
        tar.extractall(peft_dir, filter="data")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(server.engine.model_dir), peft_dir)
    assert any("lora_A" in n for n, _ in model.named_parameters())

    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in ckpts] == ["weights/step-1"]
