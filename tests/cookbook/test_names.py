"""Names resolve: the server takes the base model's hub id, short name and checkpoint dir as the
same model, and `mint model prepare` makes the hub id load offline through the hub cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

from mint_server.model.hub_cache import link_prepared, snapshot_of
from mint_server.model.prepare import DEFAULT_BASE_MODEL, prepare
from tests.service.live import BASE, KEY_A, LiveServer


@pytest.mark.parametrize("name", [BASE, "llama", "DIR", "DIR/"], ids=["hub-id", "short", "dir", "dir-slash"])
def test_server_accepts_every_name_of_its_base_model(server: LiveServer, tiny_dir: Path, name: str) -> None:
    name = name.replace("DIR", str(tiny_dir))
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=name, rank=2).result()
        assert tc.get_info().model_data.model_name == BASE  # stored under the one canonical name
        sc = client.create_sampling_client(base_model=name).result()
        # stop=[]: the default stops at EOS, which a random model samples now and then (a flake seen once)
        out = sc.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2, stop=[])).result()
        assert len(out.sequences[0].tokens) == 2
    finally:
        client.close("success")


@pytest.mark.parametrize("name", ["other/llama", "tiny/llama2", "/nonexistent/llama"])
def test_server_refuses_other_names(server: LiveServer, name: str) -> None:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        with pytest.raises(tinker.BadRequestError, match="unknown base_model"):
            client.create_lora_training_client(base_model=name, rank=2).result()
    finally:
        client.close("success")


def test_hub_cache_entry_is_idempotent_and_respects_real_downloads(tiny_dir: Path, tmp_path: Path) -> None:
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    cache = tmp_path / "hub"
    snap = link_prepared("org/tiny", tiny_dir, files, cache)
    assert snap is not None and snapshot_of("org/tiny", cache) == snap
    assert (snap / "config.json").resolve() == tiny_dir.resolve() / "config.json"
    ref = snap.parent.parent / "refs" / "main"
    before = ref.stat().st_mtime_ns
    assert link_prepared("org/tiny", tiny_dir, files, cache) == snap and ref.stat().st_mtime_ns == before
    # A real download (plain files) is never replaced.
    real = cache / "models--org--real" / "snapshots" / ("a" * 40)
    real.mkdir(parents=True)
    (real / "config.json").write_text("{}")
    (cache / "models--org--real" / "refs").mkdir()
    (cache / "models--org--real" / "refs" / "main").write_text("a" * 40)
    assert link_prepared("org/real", tiny_dir, files, cache) is None
    assert snapshot_of("org/real", cache) == real


def test_prepared_default_loads_by_hub_id_offline(mint_test_cache: Path, tmp_path: Path) -> None:
    """After `prepare`, transformers and tinker's SamplingClient.get_tokenizer path find the
    default model's tokenizer by hub id with HF_HUB_OFFLINE=1 (in a child, so the env is fresh)."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    os.environ["HF_HUB_CACHE"], saved = env["HF_HUB_CACHE"], os.environ.get("HF_HUB_CACHE")
    try:
        prepare(None, mint_test_cache)
    finally:
        if saved is None:
            del os.environ["HF_HUB_CACHE"]
        else:
            os.environ["HF_HUB_CACHE"] = saved
    code = (
        "from transformers import AutoTokenizer\n"
        "from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info\n"
        f"t = AutoTokenizer.from_pretrained({DEFAULT_BASE_MODEL!r})\n"
        f"u = _load_tokenizer_from_model_info({DEFAULT_BASE_MODEL!r})\n"
        "assert t.eos_token == u.eos_token == '<|im_end|>', (t.eos_token, u.eos_token)\n"
        "print(len(t))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "49152"
