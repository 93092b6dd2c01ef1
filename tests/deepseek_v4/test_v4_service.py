"""The service on a tiny DeepSeek-V4 base: the tinker SDK trains, saves and samples a policy with LoRA on the
attention, both compressors, the experts and the shared expert; its adapter is PEFT-named; `mint serve` starts."""

from __future__ import annotations

import json

import httpx
import pytest
import tinker
from safetensors import safe_open
from tinker import types

from tests.deepseek_v4.tiny_v4 import make_tiny_v4
from tests.service.live import BASE, KEY_A, LiveServer, ServeProcess, batch, datum, tiny_engine, train

pytestmark = pytest.mark.slow  # a live server and a `mint serve` subprocess: ~1 min


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory):
    return make_tiny_v4(tmp_path_factory.mktemp("v4-serve") / "deepseek-v4", seed=3)


def test_tinker_sdk_trains_saves_and_samples_on_deepseek_v4(serve_dir, tmp_path):
    engine = tiny_engine(serve_dir)
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            assert tc.get_info().model_data.arch == "DeepseekV4ForCausalLM"
            losses = train(tc, 8)
            assert losses[-1] < 0.8 * losses[0], losses
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11])  # past the first windows of both compressors
            res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=10, stop=[])).result()
            assert len(res.sequences) == 2 and all(len(s.tokens) == 10 for s in res.sequences)
            for s in res.sequences:
                scored = sampler.compute_logprobs(types.ModelInput.from_ints([*prompt.to_ints(), *s.tokens])).result()
                assert scored[7:] == pytest.approx(s.logprobs, abs=1e-4)
            saved = tc.save_weights_for_sampler("s1").result()
            sc = client.create_sampling_client(model_path=saved.path).result()
            lp = sc.compute_logprobs(types.ModelInput.from_ints([3, 4, 5, 6, 7, 8])).result()
            trained = tc.forward([datum([3, 4, 5, 6, 7, 8])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
            assert lp[1:] == pytest.approx(trained.tolist(), abs=1e-4)
            assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] < losses[0]
        finally:
            client.close("success")
    written = next(p for p in (tmp_path / "data").rglob("adapter_model.safetensors") if "ephemeral" not in p.parts)
    with safe_open(str(written), "pt") as f:
        keys = set(f.keys())
    for layer, module in ((1, "self_attn.q_a_proj"), (1, "self_attn.kv_proj"), (1, "self_attn.o_b_proj"),
                          (1, "self_attn.compressor.kv_proj"), (2, "self_attn.compressor.gate_proj"),
                          (0, "mlp.shared_experts.down_proj"), (0, "mlp.experts.gate_proj")):
        assert f"base_model.model.model.layers.{layer}.{module}.lora_A.weight" in keys, module
    assert not any("indexer" in k or "o_a_proj" in k for k in keys)  # frozen / no LoRA form
    assert not any("layers.0.self_attn.compressor" in k for k in keys)  # layer 0 slides only
    config = json.loads((written.parent / "adapter_config.json").read_text())
    assert {"kv_proj", "o_b_proj", "gate_proj"} <= set(config["target_modules"])


def test_mint_serve_starts_on_a_deepseek_v4_dir(serve_dir, tmp_path):
    with ServeProcess("--base-model", str(serve_dir), "--data-dir", str(tmp_path / "data"), "--device-slots", "2",
                      "--max-rank", "8", "--kv-budget-mb", "1", "--max-seq-len", "128") as served:
        caps = httpx.get(f"{served.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A}).json()
        assert caps["supported_models"][0]["model_name"] == serve_dir.name
        served.stop()
