"""`mint serve` killed with SIGKILL while a client keeps saving sampler weights: after a restart,
every revision the catalog lists is complete and verifies, and the latest one samples.

Also covers `mint serve` with no key: it creates one once in <data dir>/api_key (0600), reuses it
on restart, and never prints it."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import tinker

from mint_server.api.auth.keys import owner_id
from mint_server.catalog import Catalog, Revision
from tests.lifecycle.helpers import ServeProcess, clean_env, greedy, mint

REPO = Path(__file__).resolve().parents[2]
SAVES_BEFORE_KILL = 3


def _all_revisions(catalog: Catalog, owner: str, policy: str) -> list[Revision]:
    revisions, cursor = [], None
    while True:
        page = catalog.list_revisions(owner, policy, cursor=cursor)
        revisions += page.items
        if (cursor := page.next_cursor) is None:
            return sorted(revisions, key=lambda r: r.number)


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(lines := path.read_text().splitlines()) < n:
        assert proc.poll() is None, f"the save loop exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"only {len(lines)} saves in {timeout}s"
        time.sleep(0.02)


def _kill_mid_publish(server: ServeProcess, runs: Path, timeout: float = 30) -> None:
    """SIGKILL the server while a save is being published: its sampler weights are in place but
    their checkpoint record is not written yet (the catalog revision is written in between)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for data in runs.glob("*/sampler_weights/s*"):
            if not (data.parent.parent / "checkpoints" / "sampler_weights" / f"{data.name}.json").exists():
                server.kill(signal.SIGKILL)
                return
    server.kill(signal.SIGKILL)  # never caught in the act (a slow poll): a kill anywhere must be safe too


def test_sigkill_mid_saves_leaves_only_complete_revisions(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    key_file = data / "api_key"
    saves = tmp_path / "saves.txt"
    server = ServeProcess(tiny_dir, data, tmp_path / "serve-1.log")  # no key given: it makes one
    try:
        key = key_file.read_text().strip()
        assert key.startswith("tml-") and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        with open(saves, "w") as out, open(tmp_path / "loop.log", "w") as err:
            loop = subprocess.Popen(
                [sys.executable, "-m", "tests.lifecycle.save_loop", server.url, "durable"],
                cwd=REPO, env=clean_env(TINKER_API_KEY=key), stdout=out, stderr=err,
            )  # fmt: skip
        try:
            _wait_for_lines(saves, SAVES_BEFORE_KILL, loop)
            _kill_mid_publish(server, data / "runs")
        finally:
            loop.kill()
            loop.wait(timeout=60)
    finally:
        server.kill()
    told = saves.read_text().splitlines()  # saves acknowledged before the kill

    server = ServeProcess(tiny_dir, data, tmp_path / "serve-2.log")
    try:
        assert key_file.read_text().strip() == key  # created once, then reused
        with Catalog.open(data_dir=data) as catalog:  # a second process on the server's database
            revisions = _all_revisions(catalog, owner_id(key), "durable")
            n = len(revisions)
            # Numbered without gaps; a kill between a revision and its checkpoint record can leave at
            # most one revision the client never heard about.
            assert [r.number for r in revisions] == list(range(1, n + 1))
            assert len(told) <= n <= len(told) + 1
            # One training step before each save; each revision's parent is the one before it.
            assert [(r.step, r.parent) for r in revisions] == [
                (i, f"durable@{i - 1}" if i > 1 else None) for i in range(1, n + 1)
            ]
            for revision in revisions:
                catalog.verify(revision)  # every file present and hashing to its recorded sha256

        rest = tinker.RestClient(base_url=server.url, api_key=key)
        (run,) = rest.list_training_runs().result().training_runs
        checkpoints = [c.tinker_path for c in rest.list_checkpoints(run.training_run_id).result().checkpoints]
        # Every acknowledged save survived, and no checkpoint exists without its revision.
        assert set(told) <= set(checkpoints) and len(checkpoints) <= n

        # The CLI finds the key by itself: in the environment, else in the server's data dir.
        for args, env in [(["--data-dir", str(data)], clean_env()), ([], clean_env(TINKER_API_KEY=key))]:
            listed = json.loads(mint("revision", "list", "durable", "--server", server.url, "--json", *args, env=env).stdout)
            assert [r["number"] for r in listed["items"]] == list(range(n, 0, -1))

        client = tinker.ServiceClient(base_url=server.url, api_key=key)
        tokens, _ = greedy(client.create_sampling_client(model_path=f"tinker://durable@{n}").result())
        assert len(tokens) == 8
        client.close("success")
    finally:
        server.kill(signal.SIGTERM)
    for log in ("serve-1.log", "serve-2.log", "loop.log"):
        text = (tmp_path / log).read_text()
        assert key not in text, f"{log} shows the API key"
    assert f"API key: in {key_file}" in (tmp_path / "serve-1.log").read_text()
