"""The service on tiny DeepSeek-V3 and V3.2 bases: the tinker SDK trains, saves and samples an MLA + expert
LoRA policy; its adapter is PEFT-named; `mint serve --base-model DIR` starts on a DeepSeek dir."""

from __future__ import annotations

import json

import httpx
import pytest
import tinker
from safetensors import safe_open
from tinker import types

from tests.mla.tiny_deepseek import make_tiny_deepseek
from tests.service.live import BASE, KEY_A, LiveServer, ServeProcess, batch, datum, tiny_engine, train

pytestmark = pytest.mark.slow  # two live servers and a subprocess per base: ~1 min


@pytest.fixture(scope="module", params=["v3", "v32"])
def serve_dir(request, tmp_path_factory):
    name = {"v3": "deepseek-v3", "v32": "deepseek-v32"}[request.param]
    return make_tiny_deepseek(tmp_path_factory.mktemp("ds-serve") / name, request.param)


def test_tinker_sdk_trains_saves_and_samples_on_deepseek(serve_dir, tmp_path):
    engine = tiny_engine(serve_dir)
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            arch = {"deepseek-v3": "DeepseekV3ForCausalLM", "deepseek-v32": "DeepseekV32ForCausalLM"}[serve_dir.name]
            assert tc.get_info().model_data.arch == arch
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
            lp = sc.compute_logprobs(types.ModelInput.from_ints([3, 4, 5])).result()
            trained = tc.forward([datum([3, 4, 5])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            assert lp[1:] == pytest.approx(trained, abs=1e-4)
            assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] < losses[0]
        finally:
            client.close("success")
    # the written adapter uses PEFT's module names for MLA, shared experts, dense MLP and experts (packed)
    # (a durable checkpoint: the session's snapshots under ephemeral/ go when it ends)
    written = next(p for p in (tmp_path / "data").rglob("adapter_model.safetensors") if "ephemeral" not in p.parts)
    with safe_open(str(written), "pt") as f:
        keys = set(f.keys())
    for module in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                   "self_attn.o_proj", "mlp.shared_experts.gate_proj", "mlp.experts.down_proj"):
        assert f"base_model.model.model.layers.1.{module}.lora_A.weight" in keys, module
    assert "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight" in keys  # dense layer 0
    assert not any("indexer" in k for k in keys)  # the indexer is frozen
    config = json.loads((written.parent / "adapter_config.json").read_text())
    assert {"kv_b_proj", "q_a_proj", "gate_proj"} <= set(config["target_modules"])


def test_mint_serve_starts_on_a_deepseek_dir(serve_dir, tmp_path):
    with ServeProcess("--base-model", str(serve_dir), "--data-dir", str(tmp_path / "data"), "--device-slots", "2",
                      "--max-rank", "8", "--kv-budget-mb", "1", "--max-seq-len", "128") as served:
        caps = httpx.get(f"{served.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A}).json()
        assert caps["supported_models"][0]["model_name"] == serve_dir.name
        served.stop()
