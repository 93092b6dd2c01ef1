"""Runs and checkpoints survive a restart; a client resumes from a saved state on the new server."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine, train


def test_state_survives_restart(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with LiveServer(tiny_engine(tiny_dir), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
        losses = train(tc, 5)
        path = tc.save_state("resume").result().path
        sampler_path = tc.save_weights_for_sampler("sampler").result().path
        # Where training goes on from the saved state: the loss there, and after one more step (which
        # depends on Adam's moments as well as the weights).
        continued = train(tc, 2)
        client.close("success")
    assert continued[0] < losses[0], (losses, continued)

    with LiveServer(tiny_engine(tiny_dir), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [tc.model_id]

        # Resumed from the saved weights and optimizer state, not from scratch: it follows the
        # original run's path exactly.
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.model_id != tc.model_id
        assert train(resumed, 2) == pytest.approx(continued, rel=1e-4)

        fresh = client.create_lora_training_client(base_model=BASE, rank=8).result()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            fresh.load_state_with_optimizer(path).result()
        assert train(fresh, 2) == pytest.approx(continued, rel=1e-4)

        sc = client.create_sampling_client(model_path=sampler_path).result()
        seq = sc.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=2, stop=[])).result()
        tokens, logprobs = seq.sequences[0].tokens, seq.sequences[0].logprobs
        assert len(tokens) == 2 and logprobs is not None and all(math.isfinite(x) and x <= 0 for x in logprobs)
        client.close("success")
