"""The service on a tiny Qwen3-MoE base: the tinker SDK trains, saves and samples an expert-LoRA policy;
`mint serve --base-model DIR` starts on an MoE dir."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from mint_server.model.moe_layout import moe_layout_of
from tests.service.live import BASE, KEY_A, LiveServer, ServeProcess, batch, datum, tiny_engine, train
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def moe_serve_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe-serve") / "qwen3-moe", "qwen3_moe", tie=True)


def test_tinker_sdk_trains_saves_and_samples_an_expert_lora_policy(moe_serve_dir, tmp_path):
    engine = tiny_engine(moe_serve_dir)
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            assert tc.get_info().model_data.arch == "Qwen3MoeForCausalLM"
            losses = train(tc, 8)
            assert losses[-1] < 0.8 * losses[0], losses
            sampler = tc.save_weights_and_get_sampling_client().result()
            res = sampler.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=4, stop=[])).result()
            assert len(res.sequences) == 2 and all(len(s.tokens) == 4 for s in res.sequences)
            for s in res.sequences:
                scored = sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, *s.tokens])).result()
                assert scored[2:] == pytest.approx(s.logprobs, abs=1e-4)

            saved = tc.save_weights_for_sampler("s1").result()
            sc = client.create_sampling_client(model_path=saved.path).result()
            lp = sc.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
            trained = tc.forward([datum([1, 2, 3])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            assert lp[1:] == pytest.approx(trained, abs=1e-4)
            greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
            prompt = types.ModelInput.from_ints([9, 8, 7])
            tuned = sc.sample(prompt, 1, greedy).result().sequences[0].tokens
            assert tuned == sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
            assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] < losses[0]
            # every adapter the server wrote (checkpoints, snapshots) holds expert LoRA (train_mlp), packed;
            # read while the session lives: ending it removes its snapshots
            written = [p.parent for p in (tmp_path / "data").rglob("adapter_model.safetensors")]
            layouts = {moe_layout_of(d) for d in written}
            assert written and layouts == {"packed"}, layouts
        finally:
            client.close("success")


def test_mint_serve_starts_on_a_qwen3_moe_dir(moe_serve_dir, tmp_path):
    with ServeProcess("--base-model", str(moe_serve_dir), "--data-dir", str(tmp_path / "data"), "--device-slots",
                      "2", "--max-rank", "8", "--kv-budget-tokens", "512", "--max-seq-len", "128") as served:
        caps = httpx.get(f"{served.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A}).json()
        assert caps["supported_models"][0]["model_name"] == moe_serve_dir.name
        served.stop()
