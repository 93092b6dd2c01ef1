"""A tensor-parallel replica: `--ray … --tp 2` runs each replica's model on two gloo ranks (the
replica actor is rank 0 and spawns its follower), and it answers like a one-process engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tinker import types

from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings, FleetSettings
from tests.tiny import make_tiny_checkpoint

ray = pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'mint-server[fleet]'")

from mint_server.engine.fleet import FleetEngine  # noqa: E402 - after the skip

SETTINGS = EngineSettings(device_slots=4, max_rank=8, kv_budget_tokens=4096, max_context=256)
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
SEEDED = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])


def run(engine, prompt: list[int]) -> list[tuple[list[int], list[float]]]:
    out = []
    for params in (GREEDY, SEEDED):
        seq = engine.submit(engine.prepare_sample(None, prompt, 1, params)).result(timeout=600).sequences[0]
        out.append((list(seq.tokens), list(seq.logprobs)))
    return out


@pytest.mark.slow
def test_tensor_parallel_replica_samples_like_one_process(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "model", "qwen3", tie=False)
    one = LocalEngine(model_dir, "tiny", device="cpu", dtype=torch.float32, settings=SETTINGS)
    try:
        want = run(one, [5, 17, 33, 60])
    finally:
        one.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=96 * 1024 * 1024, log_to_driver=False)
    try:
        fleet = FleetEngine(model_dir, "tiny", settings=dataclasses.replace(SETTINGS, tp=2),
                            fleet=FleetSettings(replicas=1), device="cpu", dtype="float32")
        try:
            assert ray.get(fleet._replicas[0].handle.status.remote())["tp_ranks"] == 2
            got = run(fleet, [5, 17, 33, 60])
        finally:
            fleet.shutdown(drain=False)
    finally:
        ray.shutdown()
    for (t1, lp1), (t2, lp2) in zip(want, got, strict=True):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(lp1, lp2, strict=True)) <= 1e-5
