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
