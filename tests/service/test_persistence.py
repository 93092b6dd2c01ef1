"""Runs and checkpoints survive a restart; a client resumes from a saved state on the new server."""

from __future__ import annotations

import warnings
from pathlib import Path

import tinker
from tinker import types

from tests.service.fake_engine import FakeEngine
from tests.service.live import KEY_A, LiveServer
from tests.service.test_protocol import datum


def _step(tc: tinker.TrainingClient) -> float:
    fb = tc.forward_backward([datum([1, 2, 3, 4])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    return fb.result().metrics["loss:sum"]


def test_state_survives_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with LiveServer(FakeEngine(tmp_path / "m"), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model="fake/tiny", rank=4).result()
        losses = [_step(tc) for _ in range(3)]
        path = tc.save_state("resume").result().path
        sampler_path = tc.save_weights_for_sampler("sampler").result().path
        client.close("success")

    with LiveServer(FakeEngine(tmp_path / "m"), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [tc.model_id]
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.model_id != tc.model_id
        assert _step(resumed) < losses[-1]  # continues from the saved weights, not from scratch

        fresh = client.create_lora_training_client(base_model="fake/tiny", rank=4).result()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            fresh.load_state_with_optimizer(path).result()
        assert _step(fresh) < losses[-1]

        sc = client.create_sampling_client(model_path=sampler_path).result()
        assert sc.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=2)).result().sequences
        client.close("success")
