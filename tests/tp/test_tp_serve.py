"""`mint serve --tp 2` on a tiny Qwen3-MoE base answers the tinker SDK (train + sample) exactly like a
one-process engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.service.live import KEY_A, LiveServer, ServeProcess, tiny_engine
from tests.tiny import make_tiny_checkpoint

GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
PROMPT = types.ModelInput.from_ints([9, 8, 7, 30])


def sdk_run(url: str, base_model: str) -> tuple[list[float], list[int], list[int]]:
    """Two training steps, then greedy samples from the base and from the trained policy."""
    client = tinker.ServiceClient(base_url=url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
        data = [types.Datum(model_input=types.ModelInput.from_ints([5, 17, 33, 60, 61, 62, 63]),
                            loss_fn_inputs={"target_tokens": [17, 33, 60, 61, 62, 63, 9], "weights": [1.0] * 7})]
        losses = []
        for _ in range(2):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        base = client.create_sampling_client(base_model=base_model).result()
        tuned = tc.save_weights_and_get_sampling_client().result()
        return (losses, list(base.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens),
                list(tuned.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens))
    finally:
        client.close("success")


@pytest.mark.slow
def test_mint_serve_tp2_answers_the_tinker_sdk_like_tp1(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "tiny-moe", "qwen3_moe", tie=True)
    with LiveServer(tiny_engine(model_dir), tmp_path / "one") as server:
        want = sdk_run(server.url, "tiny/llama")
    with ServeProcess("--base-model", str(model_dir), "--data-dir", str(tmp_path / "two"), "--tp", "2",
                      "--threads", "1", "--device-slots", "2", "--max-rank", "8", "--kv-budget-tokens", "512",
                      "--max-seq-len", "128") as served:
        got = sdk_run(served.url, model_dir.name)
        served.stop()
    assert got[0] == pytest.approx(want[0], rel=1e-5), (got, want)
    assert got[1:] == want[1:], (got, want)
