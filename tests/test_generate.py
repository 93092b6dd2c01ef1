"""`mint generate` end to end (subprocess), against transformers' greedy decoding."""

import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mint_server.model.loader import load_model
from mint_server.model.peft_io import save_peft
from tests.model.test_parity import random_adapter
from tests.tiny import make_tiny_checkpoint


def run_mint(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def hf_greedy(model_dir, prompt_ids, max_tokens, adapter_dir=None) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, adapter_dir)
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_generate_matches_transformers_smollm2(smollm2_dir):
    prompt = "The three primary colors are"
    proc = run_mint("generate", "--base-model", str(smollm2_dir), "--prompt", prompt, "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ref = hf_greedy(smollm2_dir, tok(prompt)["input_ids"], 24)
    assert proc.stdout.rstrip("\n") == tok.decode(ref, skip_special_tokens=True)


def test_greedy_generate_with_adapter_matches_peft(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", tie=True)
    cfg = load_model(model_dir, device="cpu").config
    save_peft(random_adapter(cfg, rank=4, seed=7), tmp_path / "adapter", base_model=str(model_dir))
    prompt = "hello world"
    proc = run_mint("generate", "--base-model", str(model_dir), "--adapter", str(tmp_path / "adapter"),
                    "--prompt", prompt, "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = hf_greedy(model_dir, tok(prompt)["input_ids"], 12, tmp_path / "adapter")
    base = hf_greedy(model_dir, tok(prompt)["input_ids"], 12)
    assert ref != base  # the adapter changes the greedy path, so this checks it was applied
    assert proc.stdout.rstrip("\n") == tok.decode(ref, skip_special_tokens=True)


def test_prompt_longer_than_context_is_a_clear_error(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "qwen3")  # max_position_embeddings = 512
    proc = run_mint("generate", "--base-model", str(model_dir), "--prompt", "hello " * 700, "--max-tokens", "4")
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "prompt" in proc.stderr.lower()
    assert "Traceback" not in proc.stderr


def test_unknown_architecture_and_missing_weights_are_clear_errors(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    (model_dir / "model.safetensors").unlink()
    proc = run_mint("generate", "--base-model", str(model_dir), "--prompt", "hi")
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr
    cfg = (model_dir / "config.json").read_text().replace("LlamaForCausalLM", "MambaForCausalLM")
    (model_dir / "config.json").write_text(cfg)
    proc = run_mint("generate", "--base-model", str(model_dir), "--prompt", "hi")
    assert proc.returncode == 2 and "MambaForCausalLM" in proc.stderr
