"""`mint` catalog commands end to end, as subprocesses: local mode, and --server mode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.catalog.helpers import BASE_MODEL, read_dir, subprocess_env, write_peft

# The `mint` next to this interpreter (the venv's), not whatever is first on PATH.
MINT = shutil.which("mint", path=os.path.dirname(sys.executable)) or "mint"


def run(*args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([MINT, *args], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == expect, (
        f"mint {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


def test_cli_local_end_to_end(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "home")]

    def mint(*args: str) -> Any:
        return json.loads(run(*args, *data, "--json").stdout)

    assert mint("policy", "create", "chat", "--base-model", BASE_MODEL, "--rank", "2")["lora_config"] == {
        "rank": 2
    }
    p1, p2 = write_peft(tmp_path / "p1", 1), write_peft(tmp_path / "p2", 2)
    assert mint("import", str(p1), "--policy", "chat", "--note", "first")["number"] == 1
    r2 = mint("import", str(p2), "--policy", "chat", "--parent", "chat@1", "--step", "10")
    assert (r2["number"], r2["parent"], r2["step"]) == (2, "chat@1", 10)
    assert mint("alias", "set", "chat", "prod", "2", "--reason", "ship", "--actor", "ann")["revision"] == 2
    assert mint("alias", "rollback", "chat", "prod")["revision"] == 1
    history = mint("alias", "history", "chat", "prod")["items"]
    assert [(e["action"], e["from_revision"], e["to_revision"]) for e in history] == [
        ("rollback", 2, 1),
        ("set", None, 2),
    ]
    assert (history[1]["actor"], history[1]["reason"]) == ("ann", "ship")
    assert mint("revision", "show", "chat@prod")["number"] == 1
    assert [r["number"] for r in mint("revision", "list", "chat", "--limit", "1", "--all")["items"]] == [2, 1]
    assert [r["number"] for r in mint("revision", "log", "chat@2")["items"]] == [2, 1]
    assert (
        mint("eval", "record", "chat@prod", "accuracy", "0.75", "--dataset", "gsm8k")["revision"] == "chat@1"
    )
    assert [(e["value"], e["dataset"]) for e in mint("eval", "list", "chat@1")["items"]] == [(0.75, "gsm8k")]
    assert mint("export", "chat@prod", str(tmp_path / "out"))["number"] == 1
    assert read_dir(tmp_path / "out") == read_dir(p1)
    seeded = mint("catalog", "seed", "--policies", "300", "--revisions-per-policy", "2")
    assert (seeded["policies"], seeded["revisions"]) == (300, 600)
    page = mint("policy", "list", "--limit", "7")
    assert len(page["items"]) == 7 and page["next_cursor"]

    # Human output (policy show), and errors: one line on stderr, exit status 2.
    shown = run("policy", "show", "chat", *data).stdout
    assert "chat@2" in shown and "prod→1" in shown
    for args, needle in [
        (("revision", "show", "chat@nope"), "ref 'chat@nope': policy 'chat' has no alias 'nope'"),
        (("export", "chat@1", str(tmp_path / "out"), "--owner", "bob"), "policy 'chat' not found"),
    ]:
        proc = run(*args, *data, expect=2)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and needle in proc.stderr, (
            proc.stderr
        )


@pytest.mark.parametrize(
    "db_url", ["sqlite"], indirect=True
)  # the server's backend is not what is tested here
def test_cli_server_mode(server: str, tmp_path: Path) -> None:
    remote = ["--server", server, "--api-key", "erin", "--json"]
    peft = write_peft(tmp_path / "peft", 3)
    assert json.loads(run("import", str(peft), "--policy", "remote", *remote).stdout)["number"] == 1
    assert json.loads(run("alias", "set", "remote", "prod", "1", *remote).stdout)["revision"] == 1
    json.loads(run("export", "remote@prod", str(tmp_path / "out"), *remote).stdout)
    assert read_dir(tmp_path / "out") == read_dir(peft)
    listed = json.loads(run("policy", "list", *remote).stdout)["items"]
    assert [(p["name"], p["owner"]) for p in listed] == [("remote", "owner-erin")]
    proc = run("revision", "show", "remote@9", "--server", server, "--api-key", "erin", expect=2)
    assert proc.stderr.startswith("error: ") and "no revision 9" in proc.stderr
