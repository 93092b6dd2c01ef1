"""A full disk during save and publish, made real with the file-size limit (`ulimit -f`) of a real
`mint serve` process: every write past the limit fails with EFBIG, as writes on a full device fail
with ENOSPC. Saves fail with one clear error naming the checkpoint, leave no partial checkpoint, no
revision and no temp files, the server keeps serving, and once there is room the same saves work."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import KEY_A, ServeProcess, train

# Above what the catalog database and run records need here (~100 KB), below one rank-32 save of the
# tiny model (~300 KB of adapter, twice that of optimizer state).
FILE_LIMIT = 200_000


def _limit_file_size() -> None:
    # Ignored, SIGXFSZ turns into EFBIG from write(2) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, resource.RLIM_INFINITY))


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith("catalog.db")}


def test_full_disk_fails_saves_cleanly_and_they_work_once_there_is_room(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ServeProcess("--base-model", str(tiny_dir), "--data-dir", str(data), "--device-slots", "4",
                      preexec_fn=_limit_file_size) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        base = client.get_server_capabilities().supported_models[0].model_name
        tc = client.create_lora_training_client(base_model=base, rank=32).result()
        train(tc, 1)
        before = files_under(data)
        for save, name in ((tc.save_state, "w0"), (tc.save_weights_for_sampler, "s0")):
            with pytest.raises(tinker.RequestFailedError, match=rf"not enough room to write checkpoint \w+/{name}: "
                                                                 "File too large; nothing of it was kept"):
                save(name).result()
        headers = {"X-API-Key": KEY_A}
        listed = httpx.get(f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints", headers=headers).json()
        assert listed["checkpoints"] == []
        assert httpx.get(f"{server.url}/api/v1/mint/catalog/policies", headers=headers).json()["items"] == []
        assert files_under(data) == before  # no staging dir, temp file or blob left behind
        sampler = client.create_sampling_client(base_model=base).result()  # still serving
        params = types.SamplingParams(max_tokens=2, temperature=0.0, stop=[])  # never EOS-stopped: 2 tokens
        assert len(sampler.sample(types.ModelInput.from_ints([5, 6]), 1, params).result().sequences[0].tokens) == 2

        assert server.proc is not None
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        tc.save_state("w0").result()
        path = tc.save_weights_for_sampler("s0").result().path
        listed = httpx.get(f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints", headers=headers).json()
        assert sorted(c["checkpoint_id"] for c in listed["checkpoints"]) == ["sampler_weights/s0", "weights/w0"]
        [policy] = httpx.get(f"{server.url}/api/v1/mint/catalog/policies", headers=headers).json()["items"]
        assert httpx.get(f"{server.url}/api/v1/mint/catalog/policies/{policy['name']}/revisions",
                         headers=headers).json()["items"][0]["number"] == 1
        client.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints([5, 6]), 1, params).result()
        client.close("success")
        server.stop()
    assert not [p for p in data.rglob("*") if p.name.startswith((".staging", ".trash")) or p.suffix == ".tmp"]
    assert os.path.exists(data / "catalog.db")
