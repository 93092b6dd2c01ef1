"""A quantized frozen base (`--quantize int8|int4`, model/quantize.py): QLoRA.

The oracle is the same model with every quantized weight replaced by its dequantized values in fp32.
Products of many rows (a prompt, a training pass) and every backward run on the dequantized weight in
fp32, so they match the oracle under the fp32 tolerance policy (tests/tolerance.py). Products of few
rows (a decode step) run torch's packed kernels on bf16 copies of the activations with the output
rounded to bf16; there the stated bound is BF16_DECODE: each projection rounds its input and output
once (2 · u_bf16 relative), a path holds 7 projections per layer plus lm_head, and the errors of the
independent roundings add like a random walk, so 8 · u_bf16 · √(7 · layers + 1) · max(1, |logit|)
(SAFETY's 32 is not needed: no long reduction is rounded in bf16).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from mint_server.engine.settings import EngineSettings
from mint_server.model.loader import load_model
from mint_server.model.lora import LoraBatch
from mint_server.model.quantize import (
    PACKED_MAX_ROWS,
    QuantizedLinear,
    QuantizedWeight,
    quantize_model,
    resident_bytes,
)
from tests.model.test_parity import random_adapter
from tests.tolerance import Tolerance, for_model, unit_roundoff

KINDS = ("int8", "int4")


def bf16_decode_bound(cfg, expected: torch.Tensor) -> float:
    u = unit_roundoff(torch.bfloat16)
    return 8 * u * math.sqrt(7 * cfg.num_layers + 1) * max(1.0, expected.abs().max().item())


def dequantized_oracle(model_dir, quantized) -> torch.nn.Module:
    """The fp32 model with every weight replaced by the quantized model's dequantized one."""
    oracle = load_model(model_dir, device="cpu")
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(getattr(module, "weight", None), QuantizedWeight):
                oracle.get_submodule(name).weight.copy_(module.weight.dequantize(torch.float32))
    return oracle


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("out_features", [128, 96])  # 96: int4 pads to the kernel's 64-row blocks
def test_products_equal_the_dequantized_weight(kind: str, out_features: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = QuantizedWeight(kind, torch.randn(out_features, 192, generator=g) * 0.05)
    deq = w.dequantize(torch.float32)
    assert deq.shape == (out_features, 192) and not deq.requires_grad
    # many rows: BLAS on the dequantized weight in fp32
    x = torch.randn(PACKED_MAX_ROWS + 5, 192, generator=g)
    Tolerance(n=192).check(w.linear(x), F.linear(x, deq), "many rows")
    # few rows: the packed kernel on bf16 activations, accumulated in fp32, output rounded to bf16
    x = torch.randn(3, 192, generator=g)
    expected = F.linear(x.bfloat16().float(), deq)
    bound = 2 * unit_roundoff(torch.bfloat16) * max(1.0, expected.abs().max().item())
    with torch.no_grad():  # under autograd every product takes the dequantized weight
        assert (w.linear(x) - expected).abs().max().item() <= bound
    Tolerance(n=192).check(w.linear(x), F.linear(x, deq), "few rows under autograd")
    # the embedding's lookup reads the same values, bitwise
    ids = torch.tensor([[0, out_features - 1, 65], [33, 32, 64]])
    assert torch.equal(w.rows(ids), deq[ids])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_logits_match_the_dequantized_oracle(fixture: str, kind: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    model = quantize_model(load_model(model_dir, device="cpu"), kind)
    oracle = dequantized_oracle(model_dir, model)
    plain = load_model(model_dir, device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, expected = model(tokens), oracle(tokens)
        for_model(model.config).check(ours, expected, f"{kind} prompt logits vs dequantized oracle")
        assert (expected - plain(tokens)).abs().max().item() > 1e-4  # the oracle is not the fp32 base
        one = tokens[:1, :1]  # a decode step's single row: the packed kernel
        ours, expected = model(one), oracle(one)
    diff, bound = (ours - expected).abs().max().item(), bf16_decode_bound(model.config, expected)
    assert diff <= bound, f"{kind} one-row logits: max |Δ| {diff:.3g} > bf16 bound {bound:.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_lora_gradients_through_the_quantized_base_match_the_dequantized_oracle(
        kind: str, tiny_qwen3, request: pytest.FixtureRequest) -> None:
    """QLoRA: gradients reach the adapter's A and B through the frozen quantized base (its backward
    runs on the activations), never the base itself."""
    model = quantize_model(load_model(tiny_qwen3, device="cpu"), kind)
    oracle = dequantized_oracle(tiny_qwen3, model)
    adapter = random_adapter(model.config, rank=4, seed=5)
    tokens = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))

    def grads(m: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        leaves = {t: (a[None].clone().requires_grad_(), b[None].clone().requires_grad_())
                  for t, (a, b) in adapter.weights.items()}
        batch = LoraBatch(weights=leaves, rows=torch.zeros(2, dtype=torch.long), scale=torch.tensor([4.0]))
        loss = F.cross_entropy(m(tokens, lora=batch).flatten(0, 1), targets.flatten())
        loss.backward()
        return {t: (a.grad, b.grad) for t, (a, b) in leaves.items()}

    ours, expected = grads(model), grads(oracle)
    assert not any(p.requires_grad for p in model.parameters())
    tol = for_model(model.config)
    for t in expected:
        for i, side in enumerate("AB"):
            assert ours[t][i].abs().max() > 0, (t, side)
            tol.check_rel(ours[t][i], expected[t][i], f"{kind} grad {side} of {t}")


def test_resident_bytes(tiny_qwen3) -> None:
    base = resident_bytes(load_model(tiny_qwen3, device="cpu"))
    ratios = {kind: resident_bytes(quantize_model(load_model(tiny_qwen3, device="cpu"), kind)) / base
              for kind in KINDS}
    # int8: 1 byte per weight + a bf16 scale per row; int4: half a byte + a bf16 scale and zero per
    # 64 weights (norms stay fp32: a larger share in a tiny model than in SmolLM2's 0.25 / 0.14)
    assert ratios["int8"] <= 0.27 and ratios["int4"] <= 0.15, ratios
    model = quantize_model(load_model(tiny_qwen3, device="cpu"), "int8")
    assert model.lm_head.weight is model.embed_tokens.weight  # a tied table stays one table
    assert isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    from mint_server.model.compiled import unsupported

    assert unsupported(model) == "quantized base"  # its decode steps run eagerly, counted under this reason


def test_unknown_quantize_value_is_refused_naming_the_flag(tmp_path) -> None:
    import typer

    from mint_server.cli.serve import engine_settings

    with pytest.raises(ValueError, match="quantize must be one of none, int8, int4, got 'fp8'"):
        EngineSettings(quantize="fp8").check()
    with pytest.raises(typer.BadParameter) as e:
        engine_settings(tmp_path, quantize="int3")
    assert e.value.param_hint == "--quantize" and "int3" in str(e.value)
    with pytest.raises(ValueError, match="quantize int8 is supported on one rank"):
        replace(EngineSettings(), quantize="int8", batch_invariant=True).check()


def test_a_family_it_cannot_quantize_is_refused(tmp_path) -> None:
    from tests.tiny import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe"), device="cpu")
    with pytest.raises(ValueError, match="--quantize int8 is not supported for family qwen3_moe"):
        quantize_model(model, "int8")


def test_a_server_on_an_int8_base_trains_and_samples(tmp_path) -> None:
    """The real server over LocalEngine with --quantize int8: a LoRA trains on the quantized base (its
    loss falls), samples from it, and the capabilities say which base precision is served."""
    import httpx
    import tinker
    from tinker import types

    from mint_server.engine.local import LocalEngine
    from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer, train
    from tests.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "llama", "llama", tie=True)
    engine = LocalEngine(model_dir, base_model=BASE, device="cpu", dtype=torch.float32,
                         settings=replace(ENGINE_SETTINGS, quantize="int8"))
    assert isinstance(engine.model.layers[0].self_attn.q_proj, QuantizedLinear)
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1)
            losses = train(tc, 3)
            assert losses[-1] < losses[0], losses
            sampler = tc.save_weights_and_get_sampling_client()
            params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[])
            seq = sampler.sample(types.ModelInput.from_ints([5, 17, 33]), 2, params).result().sequences
            assert len(seq) == 2 and all(len(s.tokens) == 5 and len(s.logprobs) == 5 for s in seq)
            caps = httpx.get(f"{server.url}/api/v1/get_server_capabilities",
                             headers={"X-API-Key": KEY_A}).json()
            assert caps["engine_settings"]["quantize"] == "int8"
        finally:
            client.close("success")


@pytest.mark.parametrize("kind", KINDS)
def test_lora_logits_match_peft_on_the_dequantized_base(kind: str, tiny_llama, tmp_path) -> None:
    """PEFT cannot run this base quantized (its QLoRA is bitsandbytes' formats, CUDA-first), so the
    oracle is transformers + PEFT on the same weights dequantized: a prompt's LoRA logits agree under
    the fp32 policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mint_server.model.lora import LoraBank
    from mint_server.model.peft_io import load_peft, save_peft

    model = quantize_model(load_model(tiny_llama, device="cpu"), kind)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(getattr(module, "weight", None), QuantizedWeight):
                hf_name = name if name == "lm_head" else f"model.{name}"
                hf.get_submodule(hf_name).weight.copy_(module.weight.dequantize(torch.float32))
    adapter = random_adapter(model.config, rank=4, seed=3)
    save_peft(adapter, tmp_path / "adapter", base_model=str(tiny_llama))
    loaded = load_peft(tmp_path / "adapter", model.config.num_layers)
    bank = LoraBank(model.config, num_slots=1, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(0, loaded.weights, loaded.rank, loaded.alpha)
    tokens = torch.randint(0, model.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens, lora=bank.batch([0, 0]))
        ref = PeftModel.from_pretrained(hf, tmp_path / "adapter")(tokens).logits
    for_model(model.config).check(ours, ref, f"{kind} LoRA logits vs PEFT on the dequantized base")


@pytest.mark.parametrize("kind", KINDS)
def test_a_big_weight_is_dequantized_a_block_of_rows_at_a_time(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lm_head's table is never dequantized whole (forward or backward): the blocks' products
    equal the whole dequantized weight's, partial last block included."""
    from mint_server.model import quantize

    monkeypatch.setattr(quantize, "DEQUANT_BLOCK_BYTES", 64 * 192 * 4)  # blocks of 64 rows
    g = torch.Generator().manual_seed(0)
    w = QuantizedWeight(kind, torch.randn(200, 192, generator=g) * 0.05)
    deq = w.dequantize(torch.float32)
    assert len(quantize._row_blocks(w)) == 4
    x = torch.randn(PACKED_MAX_ROWS + 3, 192, generator=g, requires_grad=True)
    y = w.linear(x)
    dy = torch.randn(y.shape, generator=g)
    (y * dy).sum().backward()
    tol = Tolerance(n=200)
    tol.check(y, F.linear(x, deq), "forward by blocks")
    tol.check(x.grad, dy @ deq, "backward by blocks")
