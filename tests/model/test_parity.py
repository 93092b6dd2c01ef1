"""Our model code vs the transformers oracle (fp32): base logits, LoRA logits, mixed-adapter batches."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mint_server.model.config import ModelConfig
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, LoraBank, lora_shapes, target_experts, target_shapes
from mint_server.model.peft_io import LoraWeights, load_peft, save_peft
from tests.tolerance import for_model


def random_adapter(cfg: ModelConfig, rank: int, seed: int, targets=ALL_TARGETS) -> LoraWeights:
    """Random nonzero A and B on every target of `targets` the model has (experts: one pair each)."""
    g = torch.Generator().manual_seed(seed)
    shapes, experts = target_shapes(cfg), target_experts(cfg)
    weights = {}
    for t in targets:
        if t not in shapes:
            continue
        a_shape, b_shape = lora_shapes(shapes[t], experts.get(t, 0), rank)
        weights[t] = (torch.randn(a_shape, generator=g) * 0.1, torch.randn(b_shape, generator=g) * 0.1)
    return LoraWeights(weights=weights, rank=rank, alpha=16.0)


def hf_logits(model_dir, tokens, adapter_dir=None):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, adapter_dir)
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_base_logits_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    for_model(model.config).check(ours, hf_logits(model_dir, tokens), "logits vs transformers")


def test_smollm2_logits_match_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = load_model(smollm2_dir, device="cpu")
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]:
        tokens = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            for_model(model.config).check(model(tokens), hf_logits(smollm2_dir, tokens), prompt)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_lora_logits_match_peft(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    adapter = random_adapter(model.config, rank=4, seed=3)
    save_peft(adapter, tmp_path / "adapter", base_model=str(model_dir))
    loaded = load_peft(tmp_path / "adapter", model.config.num_layers)
    bank = LoraBank(model.config, num_slots=3, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(2, loaded.weights, loaded.rank, loaded.alpha)
    tokens = torch.randint(0, model.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens, lora=bank.batch([2, 2]))
        base = model(tokens)
    ref = hf_logits(model_dir, tokens, tmp_path / "adapter")
    assert (ours - base).abs().max().item() > 1e-2  # the adapter really changes the output
    for_model(model.config).check(ours, ref, "LoRA logits vs PEFT")


def mixed_batch(model) -> tuple[LoraBank, list[int], torch.Tensor]:
    """A bank of four adapters of ranks 1..8 and eight rows over them and the bare base."""
    bank = LoraBank(model.config, num_slots=6, max_rank=8, device="cpu", dtype=torch.float32)
    for slot, rank in zip([0, 1, 3, 5], [2, 8, 4, 1], strict=True):
        bank.write(slot, random_adapter(model.config, rank, seed=slot).weights, rank, alpha=8.0)
    row_slots = [3, -1, 0, 5, 1, 3, -1, 0]
    tokens = torch.randint(0, model.config.vocab_size, (len(row_slots), 21), generator=torch.Generator().manual_seed(4))
    return bank, row_slots, tokens


def test_mixed_batch_rows_equal_rows_alone(tiny_qwen3):
    model = load_model(tiny_qwen3, device="cpu")
    bank, row_slots, tokens = mixed_batch(model)
    with torch.no_grad():
        mixed = model(tokens, lora=bank.batch(row_slots))
        for i, slot in enumerate(row_slots):
            alone = model(tokens[i : i + 1], lora=bank.batch([slot]))
            for_model(model.config).check(mixed[i], alone[0], (i, slot))
    # distinct adapters really differ
    assert (mixed[0] - mixed[2]).abs().max().item() > 1e-3


def test_bank_slot_refill_does_not_touch_base(tiny_llama):
    model = load_model(tiny_llama, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bank = LoraBank(model.config, num_slots=2, max_rank=4, device="cpu", dtype=torch.float32)
    ptrs = {t: a.data_ptr() for t, a in bank.A.items()}
    bank.write(0, random_adapter(model.config, 4, seed=1).weights, 4, 8.0)
    bank.clear(0)
    bank.write(0, random_adapter(model.config, 2, seed=2).weights, 2, 8.0)
    assert {t: a.data_ptr() for t, a in bank.A.items()} == ptrs
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
