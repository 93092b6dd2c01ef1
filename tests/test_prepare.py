"""`mint model prepare`: the embedded default base model and validation of user checkpoints."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mint_server.model.config import ModelError
from mint_server.model.prepare import (
    DEFAULT_BASE_MODEL,
    MARKER,
    default_model_dir,
    prepare,
    resolve_base_model,
    validate_checkpoint,
)

MINT = Path(sys.executable).parent / "mint"
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def run_mint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MINT), *args], capture_output=True, text=True, env=env, timeout=600)


def make_checkpoint(path: Path, config: dict, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_default_is_a_loadable_hf_checkpoint(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2_dir.name == "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert validate_checkpoint(smollm2_dir).architecture == "LlamaForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype.is_floating_point and str(model.dtype) == "torch.float32"
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    marker = json.loads((smollm2_dir / MARKER).read_text())
    assert marker["source"] == DEFAULT_BASE_MODEL and "model.safetensors" in marker["files"]


def test_second_prepare_does_no_work(smollm2_dir: Path, mint_test_cache: Path) -> None:
    again = prepare(None, mint_test_cache)
    assert (again.path, again.did_work) == (smollm2_dir, False)
    assert resolve_base_model(None, mint_test_cache) == smollm2_dir
    assert resolve_base_model(DEFAULT_BASE_MODEL, mint_test_cache) == smollm2_dir


def test_user_checkpoint_dir_is_used_in_place(smollm2_dir: Path, mint_test_cache: Path) -> None:
    assert prepare(str(smollm2_dir), mint_test_cache).path == smollm2_dir
    assert resolve_base_model(str(smollm2_dir), mint_test_cache) == smollm2_dir


def test_cli_prints_prepared_dir_last(smollm2_dir: Path, mint_test_cache: Path) -> None:
    for args in (["--data-dir", str(mint_test_cache)], [str(smollm2_dir)]):
        result = run_mint("model", "prepare", *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1] == str(smollm2_dir)


def test_cli_uses_mint_home(smollm2_dir: Path, mint_test_cache: Path) -> None:
    result = run_mint("model", "prepare", env={**os.environ, "MINT_HOME": str(mint_test_cache)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(smollm2_dir)


@pytest.mark.parametrize(
    ("config", "files", "expected"),
    [
        (None, {}, "not a directory"),
        ({"architectures": ["GPT2LMHeadModel"]}, {}, "unsupported architecture 'GPT2LMHeadModel'"),
        (LLAMA_CONFIG, {"tokenizer.json": "{}"}, "missing weight file model.safetensors"),
        (LLAMA_CONFIG, {"model.safetensors": ""}, "no tokenizer file"),
        (
            LLAMA_CONFIG,
            {
                "model.safetensors.index.json": json.dumps(
                    {
                        "weight_map": {
                            "a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors",
                        }
                    }
                ),
                "model-00001-of-00002.safetensors": "",
                "tokenizer.json": "{}",
            },
            "missing weight file model-00002-of-00002.safetensors",
        ),
    ],
    ids=["nonexistent", "unknown-architecture", "no-weights", "no-tokenizer", "missing-shard"],
)
def test_bad_source_exits_2_naming_the_problem(
    tmp_path: Path, config: dict | None, files: dict[str, str], expected: str
) -> None:
    source = tmp_path / "ckpt"
    if config is not None:
        make_checkpoint(source, config, files)
    with pytest.raises(ModelError, match=expected):
        prepare(str(source), tmp_path / "home")
    result = run_mint("model", "prepare", str(source), "--data-dir", str(tmp_path / "home"))
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


@pytest.mark.slow
def test_reprepare_reuses_cached_gguf_and_replaces_a_stale_dir(
    smollm2_dir: Path, mint_test_cache: Path, tmp_path: Path
) -> None:
    # Seed a fresh data dir with the cached GGUF (a second download would replace it: new inode)
    # and with a half-written output dir, as a crash mid-prepare would leave.
    (tmp_path / "cache").mkdir()
    gguf = shutil.copy(next((mint_test_cache / "cache").glob("*.gguf")), tmp_path / "cache")
    inode = os.stat(gguf).st_ino
    stale = default_model_dir(tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    result = prepare(None, tmp_path)
    assert result.did_work and result.path == stale
    assert os.stat(gguf).st_ino == inode
    # The conversion is deterministic: same files, same bytes as the shared copy.
    for name in json.loads((smollm2_dir / MARKER).read_text())["files"]:
        assert (result.path / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert not [p for p in stale.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
