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


def test_training_tokens_count_in_a_keys_share(sampling_llama_dir):
    """A forward_backward's tokens are charged to its key's virtual token counter, the one the
    scheduler orders keys by (tests/engine/test_scheduler.py: a more-served key's work goes after a
    less-served one's), so a key that trains yields to a key that only samples."""
    s = EngineSettings(device_slots=2, max_rank=8, kv_budget_tokens=160, max_context=160)
    e = LocalEngine(sampling_llama_dir, "tiny", device="cpu", dtype=torch.float32, settings=s)
    try:
        adapter = e.create_adapter(types.LoraConfig(rank=4, seed=0)).result(timeout=120)
        tokens = [(7 * i) % 200 + 3 for i in range(65)]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 64})
        e.submit(e.prepare_train([datum], "cross_entropy", None, key="trainer").on(adapter)).result(timeout=120)
        assert e.report()["served"] == {"trainer": 64}
        e.submit(e.prepare_sample(None, [7, 8, 9], 1, types.SamplingParams(max_tokens=4, stop=[]),
                                  key="quiet")).result(timeout=120)
        served = e.report()["served"]
        assert served["trainer"] == 64 and 0 < served["quiet"] < 64
    finally:
        e.shutdown()
