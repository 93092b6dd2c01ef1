"""Exports load everywhere: a checkpoint archive downloaded from a live server goes through the
cookbook's build_hf_model (merge) and build_lora_adapter, and back into our own loader."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from safetensors.torch import load_file

from mint_server.model.peft_io import load_peft
from tests.service.live import KEY_A, LiveServer, batch, train


def trained_archive(server: LiveServer, dest: Path) -> tuple[Path, str]:
    """Train the tiny model (all targets, lm_head included), save sampler weights, download them."""
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=server.engine.base_model, rank=4).result()
        train(tc, 2, batch())
        path = tc.save_weights_for_sampler("final").result().path
    finally:
        client.close("success")
    # The archive route, as `curl -L` reaches it (tinker 0.38 has no client call for it).
    run_id, name = path.removeprefix("tinker://").split("/sampler_weights/")
    url = f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/sampler_weights/{name}/archive"
    resp = httpx.get(url, headers={"X-API-Key": KEY_A}, follow_redirects=True, timeout=60)
    resp.raise_for_status()
    archive = dest / "final.tar.gz"
    archive.write_bytes(resp.content)
    out = dest / "adapter"
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out, path


def test_build_hf_model_merges_archive_of_tied_model(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter

    adapter_dir, _ = trained_archive(server, tmp_path)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    assert not any(".lm_head." in k for k in tensors)  # the tiny model ties embeddings
    a = tensors["base_model.model.model.unembed_tokens.lora_A.weight"]
    b = tensors["base_model.model.model.unembed_tokens.lora_B.weight"]
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]

    merged_dir = tmp_path / "merged"
    build_hf_model(base_model=str(tiny_dir), adapter_path=str(adapter_dir), output_path=str(merged_dir),
                   dtype="float32")
    base = load_file(tiny_dir / "model.safetensors")
    merged = {}
    for f in merged_dir.glob("*.safetensors"):
        merged.update(load_file(f))
    # A tied base has one matrix for input and output; the output-layer delta lands there.
    delta = merged["model.embed_tokens.weight"] - base["model.embed_tokens.weight"]
    torch.testing.assert_close(delta, scale * b @ a, atol=1e-5, rtol=1e-4)
    qa = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    qb = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    key = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[key] - base[key], scale * qb @ qa, atol=1e-5, rtol=1e-4)

    peft_out = tmp_path / "peft"
    build_lora_adapter(base_model=str(tiny_dir), adapter_path=str(adapter_dir), output_path=str(peft_out))
    assert (peft_out / "adapter_model.safetensors").is_file()


def test_archive_imports_back_as_the_same_adapter(server: LiveServer, tmp_path: Path) -> None:
    adapter_dir, path = trained_archive(server, tmp_path)
    run_id, name = path.removeprefix("tinker://").split("/sampler_weights/")
    stored = server.settings.data_dir / "runs"
    peft_dirs = [p for p in stored.rglob("adapter_config.json") if name in str(p.parent)]
    assert peft_dirs, "sampler weights are stored as a PEFT dir"
    ours = load_peft(peft_dirs[0].parent, 2)
    archived = load_peft(adapter_dir, 2)
    assert set(ours.weights) == set(archived.weights) and "lm_head" in ours.weights
    for t, (a, b) in ours.weights.items():
        torch.testing.assert_close(archived.weights[t][0], a, rtol=0, atol=0)
        torch.testing.assert_close(archived.weights[t][1], b, rtol=0, atol=0)


def test_peft_loads_the_stored_adapter_with_lm_head(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    """Our PEFT dirs keep PEFT's own name for the output layer, which PEFT applies to lm_head only."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, path = trained_archive(server, tmp_path)
    name = path.rsplit("/", 1)[-1]
    peft_dir = next(p.parent for p in (server.settings.data_dir / "runs").rglob("adapter_config.json")
                    if name in str(p.parent))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), peft_dir)
    assert "lm_head" in {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n.endswith("lm_head")}
    assert any("lm_head.lora_A" in n for n, _ in model.named_parameters())


def _serves_external_weights(server: LiveServer) -> bool:
    return any("external" in getattr(route, "path", "") for route in server.app.routes)


def test_weights_download_then_build_hf_model(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    """The cookbook's documented path: weights.download of a training checkpoint, then merge."""
    if not _serves_external_weights(server):
        pytest.skip("weights.download needs save_weights_external and external_weights_urls, which this "
                    "server does not serve yet (the Tinker-completeness work adds them); the archive "
                    "route carries the same files (test_build_hf_model_merges_archive_of_tied_model)")
    from tinker_cookbook.weights import build_hf_model, download

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=server.engine.base_model, rank=4).result()
        train(tc, 1, batch())
        state = tc.save_state("final").result().path
    finally:
        client.close("success")
    adapter = download(tinker_path=state, output_dir=str(tmp_path / "adapter"), base_url=server.url)
    build_hf_model(base_model=str(tiny_dir), adapter_path=adapter, output_path=str(tmp_path / "merged"),
                   dtype="float32")
    assert any((tmp_path / "merged").glob("*.safetensors"))
