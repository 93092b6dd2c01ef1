"""Fair admission across keys: one tenant's largest request does not starve another's small one."""

from __future__ import annotations

import torch
from tinker import types

from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings


def test_a_small_request_from_another_key_overtakes_a_big_one(sampling_llama_dir):
    # The KV pool holds 4 sequences of 16 + 128 tokens: the heavy key's 12 samples go in 3 waves.
    s = EngineSettings(device_slots=2, max_rank=8, kv_budget_tokens=4 * 160, max_context=160)
    e = LocalEngine(sampling_llama_dir, "tiny", device="cpu", dtype=torch.float32, settings=s)
    try:
        e.pause()
        long = types.SamplingParams(max_tokens=128, temperature=1.0, seed=1, stop=[])
        heavy = e.submit(e.prepare_sample(None, list(range(3, 19)), 12, long, key="heavy"))
        heavy_more = e.submit(e.prepare_sample(None, list(range(5, 21)), 4, long, key="heavy"))
        quiet = e.submit(e.prepare_sample(None, [7, 8, 9], 1, types.SamplingParams(max_tokens=4, stop=[]),
                                          key="quiet"))
        e.resume()
        assert len(quiet.result(timeout=300).sequences[0].tokens) == 4
        # FIFO would have run all 16 heavy samples (4 waves of 128 steps) first.
        assert not heavy.done() and not heavy_more.done()
        assert len(heavy.result(timeout=600).sequences) == 12 and len(heavy_more.result(timeout=600).sequences) == 4
    finally:
        e.shutdown()
