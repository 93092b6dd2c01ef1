"""Batch-invariant mode through the tinker SDK: a policy's samples and logprobs are identical alone
and beside 15 busy co-tenants of another key (docs/numerics.md)."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tinker
import torch
from tinker import types

from mint_server.engine.local import LocalEngine
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, KEY_B, LiveServer, train


def _wait_until(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.01)


def test_samples_alone_equal_those_beside_15_busy_co_tenants(tiny_dir: Path, tmp_path: Path) -> None:
    settings = dataclasses.replace(ENGINE_SETTINGS, batch_invariant=True)
    engine = LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=settings)
    with LiveServer(engine, tmp_path / "data") as server:
        a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        tc = a.create_lora_training_client(base_model=BASE, rank=8).result()
        train(tc, 1)
        sc = tc.save_weights_and_get_sampling_client(name="mine").result()
        prompt = types.ModelInput.from_ints([5, 17, 33, 60, 61])
        params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=7)
        alone = sc.sample(prompt, 2, params).result()

        neighbours = [b.create_lora_training_client(base_model=BASE, rank=4, seed=k).result() for k in range(3)]
        busy_clients = [t.save_weights_and_get_sampling_client(name=f"theirs-{k}").result()
                        for k, t in enumerate(neighbours)]
        busy_clients.append(b.create_sampling_client(base_model=BASE).result())
        server.engine.pause()  # all 16 requests reach the engine before any runs: they share steps
        # (the SDK's sample() waits for the server's answer, which waits for the paused engine: threads)
        with ThreadPoolExecutor(16) as pool:
            try:
                busy = [pool.submit(lambda k=k: busy_clients[k % 4].sample(
                    types.ModelInput.from_ints([7 + k, 8, 9 + k % 5]), 1,
                    types.SamplingParams(max_tokens=24, temperature=1.0, seed=k)).result()) for k in range(15)]
                mine = pool.submit(lambda: sc.sample(prompt, 2, params).result())
                _wait_until(lambda: len(server.engine._queue) >= 16,
                            lambda: f"the 16 sample requests to be queued ({len(server.engine._queue)} are)")
            finally:
                server.engine.resume()
            crowded = mine.result()
            assert all(f.result().sequences[0].tokens for f in busy)
        assert [s.tokens for s in crowded.sequences] == [s.tokens for s in alone.sequences]
        assert [s.logprobs for s in crowded.sequences] == [s.logprobs for s in alone.sequences]  # bitwise
