"""Residency through the official tinker SDK: more live training clients and servable policies
than the engine has device slots, each with the results it gets alone."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import tinker
import torch
from tinker import types

from mint_server.engine.local import LocalEngine
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer, batch

ADAM = types.AdamParams(learning_rate=2e-2)
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
PROMPT = types.ModelInput.from_ints([5, 17, 33, 60])


def server_with(tiny_dir: Path, data: Path, slots: int, host_mb: float) -> LiveServer:
    s = replace(ENGINE_SETTINGS, device_slots=slots, host_cache_mb=host_mb, store_dir=data / "pages")
    return LiveServer(LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=s), data)


def one_client(sc: tinker.ServiceClient, i: int) -> tuple[list[float], list[int]]:
    """Train 3 steps with a save_state after the first and a resume from it before the last; the
    losses, and greedy tokens of the final weights through a saved sampler revision."""
    tc = sc.create_lora_training_client(BASE, rank=4, seed=i, user_metadata={"policy": f"p{i}"}).result()
    data = [d for k, d in enumerate(batch()) if k != i % 2] + batch()[: 1 + i % 2]
    losses = []
    saved = None
    for step in range(3):
        if step == 2:
            tc = sc.create_training_client_from_state_with_optimizer(saved).result()  # resume
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
        if step == 0:
            saved = tc.save_state(f"s{i}").result().path
    path = tc.save_weights_for_sampler(f"w{i}").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    tokens = list(sampler.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens)
    return losses, tokens


def all_clients(server: LiveServer, n: int) -> list:
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = one_client(sc, i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, repr(errors[0])
    return results


def test_24_sdk_training_clients_on_4_slots(tiny_dir: Path, tmp_path: Path) -> None:
    """A host cache of ~6 adapters (with their Adam state): most clients live in the store at any time."""
    n = 24
    with server_with(tiny_dir, tmp_path / "roomy", slots=128, host_mb=1024) as server:
        expected = all_clients(server, n)  # every adapter resident all along: nothing is paged
        assert server.engine.residency.stats.evictions["device"] == 0
    with server_with(tiny_dir, tmp_path / "busy", slots=4, host_mb=0.6) as server:
        results = all_clients(server, n)
        stats = server.engine.residency.stats
    for (exp_losses, exp_tokens), (losses, tokens) in zip(expected, results, strict=True):  # noqa: B007
        assert losses == pytest.approx(exp_losses, abs=1e-6, rel=1e-6)
        assert tokens == exp_tokens
    assert stats.evictions["device"] > 0 and stats.evictions["host"] > 0 and stats.loads["store"] > 0
