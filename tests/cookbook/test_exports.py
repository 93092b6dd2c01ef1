"""Exports load everywhere: a checkpoint archive downloaded from a live server goes through the
cookbook's build_hf_model (merge) and build_lora_adapter, and back into our own loader."""

from __future__ import annotations

import io
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


def test_weights_download_then_build_hf_model(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    """The cookbook's documented path: weights.download of a training checkpoint (a temporary
    encrypted save_weights_external, fetched through signed URLs, then deleted), then merge."""
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter, download

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=server.engine.base_model, rank=4).result()
        train(tc, 1, batch())
        state = tc.save_state("final").result().path
        sampler = tc.save_weights_for_sampler("final").result().path
    finally:
        client.close("success")
    adapter = download(tinker_path=state, output_dir=str(tmp_path / "adapter"), base_url=server.url)
    assert sorted(p.name for p in Path(adapter).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # The same weights as the sampler checkpoint saved at that step, under the archive's names.
    downloaded = load_file(Path(adapter) / "adapter_model.safetensors")
    archived = load_file(trained_archive_of(server, sampler, tmp_path) / "adapter_model.safetensors")
    assert downloaded.keys() == archived.keys()
    assert all(torch.equal(downloaded[k], archived[k]) for k in downloaded)
    # The temporary export was deleted after the download.
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    run_id = state.removeprefix("tinker://").split("/")[0]
    kinds = {c.checkpoint_type for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert "external" not in kinds

    build_hf_model(base_model=str(tiny_dir), adapter_path=adapter, output_path=str(tmp_path / "merged"),
                   dtype="float32")
    assert any((tmp_path / "merged").glob("*.safetensors"))
    build_lora_adapter(base_model=str(tiny_dir), adapter_path=adapter, output_path=str(tmp_path / "peft"))
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()


def trained_archive_of(server: LiveServer, sampler_path: str, dest: Path) -> Path:
    run_id, name = sampler_path.removeprefix("tinker://").split("/sampler_weights/")
    url = f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/sampler_weights/{name}/archive"
    resp = httpx.get(url, headers={"X-API-Key": KEY_A}, follow_redirects=True, timeout=60)
    resp.raise_for_status()
    out = dest / "archive"
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        tar.extractall(out, filter="data")
    return out


def test_external_weights_urls_are_signed_owned_and_expire_with_the_checkpoint(server: LiveServer,
                                                                                tmp_path: Path) -> None:
    """An external export of one owner: plain files behind signed URLs that need no key, that
    another owner cannot obtain, and that stop working once the checkpoint is deleted."""
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=server.engine.base_model, rank=4).result()
        train(tc, 1, batch())
        path = tc.save_weights_external("plain", ttl_seconds=7200).result().path
        assert path == f"tinker://{tc.model_id}/external_weights/plain"
        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="already exists"):
            tc.save_weights_external("plain").result()
        with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
            tc.save_weights_external("sealed", age_encryption_recipients=["not-a-key"]).result()
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            tc.save_weights_external("short", ttl_seconds=5).result()
        # Exports are for download only: not a sampler source.
        with pytest.raises(tinker.BadRequestError, match="external weights"):
            client.create_sampling_client(model_path=path).result()
    finally:
        client.close("success")
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    ckpt = next(c for c in rest.list_checkpoints(tc.model_id).result().checkpoints if c.checkpoint_type == "external")
    assert ckpt.tinker_path == path and ckpt.expires_at is not None and ckpt.size_bytes > 0
    answer = rest.get_external_weights_urls(path).result()
    assert sorted(answer.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    url = answer.urls["adapter_config.json"]
    assert url.startswith(server.url) and json.loads(httpx.get(url).content)["r"] == 4  # no key needed
    assert httpx.get(url.replace("adapter_config.json", "adapter_model.safetensors")).status_code == 404

    from tests.service.live import KEY_B

    other = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        other.get_external_weights_urls(path).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(url).status_code == 404
