"""The Tinker protocol end to end, real tinker SDK against a live server, with the fake engine."""

from __future__ import annotations

import httpx
import tinker
from tinker import types

from tests.service.live import KEY_A, LiveServer


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_health_and_capabilities(fake_server: LiveServer) -> None:
    assert httpx.get(f"{fake_server.url}/api/v1/healthz").json() == {"status": "ok"}
    rest = tinker.RestClient(base_url=fake_server.url, api_key=KEY_A)
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["fake/tiny"]


def test_training_loop(client_a: tinker.ServiceClient, fake_server: LiveServer) -> None:
    tc = client_a.create_lora_training_client(base_model="fake/tiny", rank=4).result()
    assert tc.get_info().lora_rank == 4
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum([1, 2, 3, 4, 5])], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=0.1))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] < losses[0]
    out = tc.forward([datum([1, 2, 3])], "cross_entropy").result()
    assert out.loss_fn_outputs[0]["logprobs"].shape == [2]


def test_checkpoints_sampling_and_rest(client_a: tinker.ServiceClient, fake_server: LiveServer) -> None:
    tc = client_a.create_lora_training_client(base_model="fake/tiny", rank=4).result()
    tc.forward_backward([datum([1, 2, 3])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    state = tc.save_state("step-1").result()
    assert state.path == f"tinker://{tc.model_id}/weights/step-1"

    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=3)).result()
    assert len(res.sequences) == 2 and len(res.sequences[0].tokens) == 3
    assert res.sequences[0].logprobs is not None and res.sequences[0].sequence_id

    saved = tc.save_weights_for_sampler("s1").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/s1"
    sc = client_a.create_sampling_client(model_path=saved.path).result()
    assert sc.get_base_model() == "fake/tiny"
    lp = sc.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
    assert lp[0] is None and lp[1] == -1.0

    rest = tinker.RestClient(base_url=fake_server.url, api_key=KEY_A)
    runs = rest.list_training_runs().result()
    assert [r.training_run_id for r in runs.training_runs] == [tc.model_id]
    assert runs.training_runs[0].lora_rank == 4
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.checkpoint_id for c in ckpts} == {"weights/step-1", "sampler_weights/s1"}
    info = rest.get_weights_info_by_tinker_path(state.path).result()
    assert info.lora_rank == 4 and info.base_model == "fake/tiny"

    # Archive: 302 to a signed URL that works without the key.
    r = httpx.get(
        f"{fake_server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/sampler_weights/s1/archive",
        headers={"X-API-Key": KEY_A},
    )
    assert r.status_code == 302
    archive = httpx.get(r.headers["Location"])
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/gzip"

    rest.delete_checkpoint_from_tinker_path(saved.path).result()
    ckpts = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in ckpts] == ["weights/step-1"]
