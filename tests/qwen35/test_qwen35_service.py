"""The service on tiny Qwen3.5 bases: the tinker SDK trains, saves and samples a policy with LoRA on the
gated delta net, attention, MLP / experts; the adapter it writes is PEFT-named and transformers + PEFT
load it (dense: same logprobs as the server's)."""

from __future__ import annotations

import json

import pytest
import tinker
import torch
from safetensors import safe_open
from tinker import types

from tests.qwen35.tiny_qwen35 import make_tiny_qwen35
from tests.service.live import BASE, KEY_A, LiveServer, batch, datum, tiny_engine, train


@pytest.fixture(scope="module", params=["dense", "moe"])
def serve_dir(request, tmp_path_factory):
    return make_tiny_qwen35(tmp_path_factory.mktemp("q35-serve") / f"qwen35-{request.param}",
                            moe=request.param == "moe")


def test_tinker_sdk_trains_saves_and_samples_on_qwen35(serve_dir, tmp_path):
    moe = serve_dir.name.endswith("moe")
    engine = tiny_engine(serve_dir)
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            assert tc.get_info().model_data.arch == ("Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM")
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
            prompt = [3, 4, 5, 60, 61, 62]
            lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
            trained = tc.forward([datum(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            assert lp[1:] == pytest.approx(trained, abs=1e-4)
            assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] < losses[0]
        finally:
            client.close("success")
    written = next(p for p in (tmp_path / "data").rglob("adapter_model.safetensors") if "ephemeral" not in p.parts)
    with safe_open(str(written), "pt") as f:
        keys = set(f.keys())
    modules = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
               "linear_attn.out_proj"]
    for m in modules:
        assert f"base_model.model.model.layers.0.{m}.lora_A.weight" in keys, m
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight" in keys  # layer 1: full attention
    assert not any("layers.0.self_attn" in k or "layers.1.linear_attn" in k for k in keys)
    if moe:
        assert "base_model.model.model.layers.2.mlp.shared_expert.up_proj.lora_A.weight" in keys
        assert "base_model.model.model.layers.2.mlp.experts.up_proj.lora_A.weight" in keys  # packed
        assert not any("shared_expert_gate" in k or "mlp.gate." in k for k in keys)  # the gates stay frozen
        return
    # the written adapter as transformers + PEFT load it: the server's logprobs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((written.parent / "adapter_config.json").read_text())
    assert {"in_proj_qkv", "out_proj", "q_proj", "gate_proj"} <= set(config["target_modules"])
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(serve_dir, dtype=torch.float32),
                                   written.parent)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    assert lp[1:] == pytest.approx([ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], abs=1e-4)
