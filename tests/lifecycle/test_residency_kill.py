"""kill -9 while training adapters are paged out of memory: after a restart every client's last
saved state resumes exactly, and every catalog revision verifies (no record points at a missing blob)."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import tinker
from tinker import types

from mint_server.api.auth.keys import owner_id
from mint_server.catalog import Catalog
from tests.lifecycle.helpers import ServeProcess, clean_env
from tests.service.live import batch

ADAM = types.AdamParams(learning_rate=2e-2)
CLIENTS = 6


def test_kill_9_with_adapters_paged_out(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    # 2 slots and a host cache of ~2 adapters: most of the 6 clients live in the store.
    tight = ("--device-slots", "2", "--host-cache-mb", "0.2")
    server = ServeProcess(tiny_dir, data, tmp_path / "serve-1.log", extra=tight)
    key = (data / "api_key").read_text().strip()
    saved: list[tuple[str, float]] = []  # (state path, forward loss of the saved weights)
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=key)
        clients = [sc.create_lora_training_client("llama", rank=4, seed=i,
                                                  user_metadata={"policy": f"k{i}"}).result() for i in range(CLIENTS)]
        for _step in range(2):
            for tc in clients:
                tc.forward_backward(batch(), "cross_entropy").result()
                tc.optim_step(ADAM).result()
        for i, tc in enumerate(clients):
            path = tc.save_state(f"last-{i}").result().path
            tc.save_weights_for_sampler(f"rev-{i}").result()
            loss = tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"]
            saved.append((path, loss))
        for tc in clients:  # more work after the saves: pending gradients, paged out with the rest
            tc.forward_backward(batch(), "cross_entropy").result()
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'mint_adapters_resident{tier="store"}' in metrics
        store = [line for line in metrics.splitlines() if line.startswith('mint_adapters_resident{tier="store"}')]
        assert float(store[0].split()[-1]) >= 1  # some adapters were paged out when we kill
    finally:
        server.kill(signal.SIGKILL)

    server = ServeProcess(tiny_dir, data, tmp_path / "serve-2.log", env=clean_env(), extra=tight)
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=key)
        for path, loss in saved:
            tc = sc.create_training_client_from_state_with_optimizer(path).result()
            assert tc.forward(batch(), "cross_entropy").result().metrics["loss:sum"] == loss
        with Catalog.open(data_dir=data) as catalog:
            for i in range(CLIENTS):
                (revision,) = catalog.list_revisions(owner_id(key), f"k{i}").items
                catalog.verify(revision)
    finally:
        server.kill(signal.SIGTERM)
    assert not (data / "pages").exists()  # pages live and die with their process
