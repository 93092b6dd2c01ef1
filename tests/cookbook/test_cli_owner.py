"""The CLI sees what the server made: local mode acts, by default, as the owner of the data dir's
own API key (the one `mint serve` creates), so policies trained through that server list."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import tinker

from tests.catalog.helpers import subprocess_env
from tests.service.live import KEY_A, LiveServer, batch, train

MINT = shutil.which("mint", path=os.path.dirname(sys.executable)) or "mint"


def mint(*args: str, expect: int = 0) -> Any:
    proc = subprocess.run([MINT, *args, "--json"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == expect, proc.stderr
    return json.loads(proc.stdout) if expect == 0 else proc.stderr


def test_policies_trained_through_the_server_list_locally(server: LiveServer) -> None:
    data_dir = server.settings.data_dir
    (data_dir / "api_key").write_text(KEY_A + "\n")  # what `mint serve` keeps when given no key
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(
            base_model=server.engine.base_model, rank=2, user_metadata={"policy": "arith"}
        ).result()
        train(tc, 1, batch())
        tc.save_weights_for_sampler("s1").result()
    finally:
        client.close("success")
    d = ["--data-dir", str(data_dir)]
    mint("policy", "create", "scratch", "--base-model", "tiny/llama", "--owner", "local", *d)

    assert [p["name"] for p in mint("policy", "list", *d)["items"]] == ["arith"]
    assert [r["number"] for r in mint("revision", "list", "arith", *d)["items"]] == [1]
    assert [p["name"] for p in mint("policy", "list", "--owner", "local", *d)["items"]] == ["scratch"]
    everyone = mint("policy", "list", "--all-owners", *d)["items"]
    assert sorted(p["name"] for p in everyone) == ["arith", "scratch"]
    assert "cannot be combined with --server" in mint(
        "policy", "list", "--all-owners", "--server", server.url, *d, expect=2
    )


def test_policies_made_before_the_first_serve_belong_to_its_key(tiny_dir, tmp_path) -> None:
    """One owner rule whatever runs first: a local command on a fresh data dir makes the data dir's
    key, and `mint serve` started later (given no key) uses that key, so it sees those policies."""
    import httpx

    from tests.service.live import ServeProcess

    data = tmp_path / "data"
    mint("policy", "create", "early", "--base-model", "tiny/llama", "--data-dir", str(data))
    key = (data / "api_key").read_text().strip()
    assert (data / "api_key").stat().st_mode & 0o077 == 0  # made private, as `mint serve` makes it
    with ServeProcess("--base-model", str(tiny_dir), "--data-dir", str(data), keys="") as served:
        listed = httpx.get(f"{served.url}/api/v1/mint/catalog/policies", headers={"X-API-Key": key})
        assert [p["name"] for p in listed.json()["items"]] == ["early"]
    assert [p["name"] for p in mint("policy", "list", "--data-dir", str(data))["items"]] == ["early"]
