"""The service on tiny gpt-oss and GLM-5 bases: the tinker SDK trains, saves and samples a policy with LoRA
on every target; the adapter it writes is PEFT-named; `mint serve --base-model DIR` starts on either."""

from __future__ import annotations

import json

import httpx
import pytest
import tinker
from safetensors import safe_open
from tinker import types

from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings
from mint_server.engine.values import NotSupportedError
from tests.families.tiny_families import make_tiny_glm, make_tiny_gpt_oss
from tests.service.live import BASE, KEY_A, LiveServer, ServeProcess, batch, datum, tiny_engine

ARCH = {"gpt-oss": "GptOssForCausalLM", "glm-5": "GlmMoeDsaForCausalLM"}
# a module of each kind the adapter must name (layer 1: sparse in both tiny configs)
MODULES = {"gpt-oss": ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts.gate_proj", "mlp.experts.down_proj"),
           "glm-5": ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.shared_experts.up_proj", "mlp.experts.down_proj")}


def train(tc, steps: int, lr: float = 1e-2) -> list[float]:
    """forward_backward + optim_step rounds; the losses before each step (these MoE bases with their
    decisive routers overshoot at the dense tests' 2e-2)."""
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(batch(), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


@pytest.fixture(scope="module", params=["gpt-oss", "glm-5"])
def serve_dir(request, tmp_path_factory):
    make = make_tiny_gpt_oss if request.param == "gpt-oss" else make_tiny_glm
    return make(tmp_path_factory.mktemp("fam-serve") / request.param)


def test_tinker_sdk_trains_saves_and_samples(serve_dir, tmp_path):
    engine = tiny_engine(serve_dir)
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            assert tc.get_info().model_data.arch == ARCH[serve_dir.name]
            losses = train(tc, 8)
            assert losses[-1] < 0.8 * losses[0], losses
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11])  # longer than gpt-oss's window (5)
            res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, stop=[])).result()
            assert len(res.sequences) == 2 and all(len(s.tokens) == 4 for s in res.sequences)
            for s in res.sequences:
                scored = sampler.compute_logprobs(types.ModelInput.from_ints([*prompt.to_ints(), *s.tokens])).result()
                assert scored[7:] == pytest.approx(s.logprobs, abs=1e-4)
            saved = tc.save_weights_for_sampler("s1").result()
            sc = client.create_sampling_client(model_path=saved.path).result()
            lp = sc.compute_logprobs(types.ModelInput.from_ints([3, 4, 5, 6, 7, 8, 9, 10])).result()
            trained = tc.forward([datum([3, 4, 5, 6, 7, 8, 9, 10])], "cross_entropy").result()
            assert lp[1:] == pytest.approx(trained.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4)
            assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] < losses[0]
        finally:
            client.close("success")
    written = next(p for p in (tmp_path / "data").rglob("adapter_model.safetensors") if "ephemeral" not in p.parts)
    with safe_open(str(written), "pt") as f:
        keys = set(f.keys())
    for module in MODULES[serve_dir.name]:
        assert f"base_model.model.model.layers.1.{module}.lora_A.weight" in keys, module
    assert not any(k for k in keys if "router" in k or "sinks" in k or "indexer" in k or ".gate.lora" in k)
    assert "base_model.model.lm_head.lora_B.weight" in keys
    config = json.loads((written.parent / "adapter_config.json").read_text())
    assert {"q_proj" if serve_dir.name == "gpt-oss" else "kv_b_proj", "down_proj"} <= set(config["target_modules"])


@pytest.mark.slow
def test_mint_serve_starts_on_the_family_dir(serve_dir, tmp_path):
    with ServeProcess("--base-model", str(serve_dir), "--data-dir", str(tmp_path / "data"), "--device-slots", "2",
                      "--max-rank", "8", "--kv-budget-mb", "1", "--max-seq-len", "128") as served:
        caps = httpx.get(f"{served.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A}).json()
        assert caps["supported_models"][0]["model_name"] == serve_dir.name
        served.stop()


def test_tensor_parallel_engine_is_refused_by_name(serve_dir):
    """Before any follower is spawned: the error names the architecture and what does not split."""
    with pytest.raises(NotSupportedError, match=f"tp: tensor parallelism is not supported for {ARCH[serve_dir.name]}"):
        LocalEngine(serve_dir, base_model=BASE, device="cpu", settings=EngineSettings(tp=2))
