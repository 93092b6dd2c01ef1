"""The service on the real LocalEngine with a tiny random Llama: real SDKs, real training math."""

from __future__ import annotations

import io
import tarfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from tinker import types

from tests.service.clients import mint_client_dir, run_script
from tests.service.live import KEY_A, KEY_SK, LiveServer
from tests.tiny import make_tiny_checkpoint

try:
    from mint_server.engine.local import LocalEngine
except ImportError as e:  # the engine lands separately; these tests wait for it
    pytest.skip(f"mint_server.engine.local.LocalEngine does not import yet ({e})", allow_module_level=True)

BASE = "tiny/llama"
LR = 2e-2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama")


def engine(model_dir: Path) -> LocalEngine:
    return LocalEngine(model_dir, base_model=BASE, device="cpu", dtype=torch.float32)


@pytest.fixture
def server(tiny_dir: Path, tmp_path: Path) -> Iterator[LiveServer]:
    with LiveServer(engine(tiny_dir), tmp_path / "data") as s:
        yield s


def batch() -> list[types.Datum]:
    seqs = [[5, 17, 33, 60, 61, 62, 63, 9], [100, 101, 102, 103, 104, 105]]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]


def train(tc: tinker.TrainingClient, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(batch(), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def test_training_sampling_and_rest(server: LiveServer, tiny_dir: Path) -> None:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=BASE, rank=8).result()
    assert tc.get_tokenizer().encode("hello") is not None  # tokenizer_id loads offline
    losses = train(tc, 8)
    assert losses[-1] < 0.8 * losses[0], losses
    fwd = tc.forward(batch(), "cross_entropy").result()
    assert fwd.loss_fn_outputs[0]["logprobs"].shape == [7]

    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints([5, 17, 33]), 2, types.SamplingParams(max_tokens=5)).result()
    assert len(res.sequences) == 2
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.tokens) for s in res.sequences)

    def custom(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
        return loss, {"custom:sum": float(loss.detach())}

    out = tc.forward_backward_custom(batch(), custom).result()
    assert "custom:sum" in out.metrics and "surrogate_loss:sum" in out.metrics
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()

    saved = tc.save_weights_for_sampler("final").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [tc.model_id]
    assert "sampler_weights/final" in {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}

    # The archive holds a PEFT adapter that peft loads onto the HF model.
    r = httpx.get(
        f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/sampler_weights/final/archive",
        headers={"X-API-Key": KEY_A},
    )
    blob = httpx.get(r.headers["Location"], timeout=60).content
    peft_dir = server.settings.data_dir / "unpacked"
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        tar.extractall(peft_dir, filter="data")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), peft_dir)
    assert any("lora_A" in n for n, _ in model.named_parameters())

    rest.delete_checkpoint_from_tinker_path(saved).result()
    assert "sampler_weights/final" not in {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    client.close("success")


def test_resume_after_restart(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with LiveServer(engine(tiny_dir), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=8).result()
        losses = train(tc, 5)
        path = tc.save_state("resume").result().path
        client.close("success")

    with LiveServer(engine(tiny_dir), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        fresh = client.create_lora_training_client(base_model=BASE, rank=8).result()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            fresh.load_state_with_optimizer(path).result()
        after = train(fresh, 3)
        assert after[0] < losses[0] and after[-1] < losses[-1], (losses, after)
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        assert train(resumed, 1)[0] < losses[0]
        client.close("success")


def test_mint_client_on_engine(server: LiveServer) -> None:
    out = run_script(
        Path(__file__).with_name("mint_client_script.py"),
        mint_client_dir(),
        {"MINT_BASE_URL": server.url, "MINT_API_KEY": KEY_SK, "BASE_MODEL": BASE, "LEARNING_RATE": str(LR)},
    )
    assert out["losses"][-1] < out["losses"][0]
