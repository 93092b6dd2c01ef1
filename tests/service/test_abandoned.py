"""Abandoned work stops: when a Tinker session ends (the SDK closes it) or expires (its heartbeats
stop), its queued and running samples are cancelled in the engine and their KV freed, while other
sessions' samples run on. The real SDK against a live server; the engine is held with pause()."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, tiny_engine

LONG = types.SamplingParams(max_tokens=200, stop=[])  # far longer than the test lets it run


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def metric(server: LiveServer, name: str) -> float:
    """One sample of /metrics: `name` summed over its labels, or `name{labels}` exactly."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$" if "{" not in name else rf"^{re.escape(name)} (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


@pytest.fixture
def server(tiny_dir: Path, tmp_path: Path) -> Iterator[LiveServer]:
    # Sessions expire 8 s after their last heartbeat; upkeep looks often. The SDK heartbeats only
    # every 10 s, so the tests keep their sessions alive themselves (see keepalive).
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "data", session_ttl_s=8.0, upkeep_interval_s=0.05) as s:
        yield s


def keepalive(server: LiveServer, client: tinker.ServiceClient, key: str) -> Callable[[], None]:
    """Heartbeat `client`'s session every 0.1 s until the returned stop is called (the client "dies")."""
    session_id, stop = client.holder.get_session_id(), threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            httpx.post(f"{server.url}/api/v1/session_heartbeat", json={"session_id": session_id},
                       headers={"X-API-Key": key}, timeout=30)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return lambda: (stop.set(), thread.join())


def hold_engine_once_running(server: LiveServer) -> tuple[threading.Event, Callable[[], None]]:
    """Pause the engine right after the first sampler step that holds KV: the running sample keeps
    its KV, and everything submitted after it waits in the engine queue."""
    engine, sampler = server.engine, server.engine.sampler
    step, running = sampler.step, threading.Event()

    def gated_step() -> None:
        step()
        if sampler.kv_blocks_in_use and not running.is_set():
            engine.pause()
            running.set()

    sampler.step = gated_step
    return running, lambda: setattr(sampler, "step", step)


def abandon_and_check(server: LiveServer, end_session: Callable[[tinker.ServiceClient], None],
                      client_polls: bool = True) -> None:
    """client_polls: the abandoned client still polls its futures afterwards (an expired session's
    client does; a closed one has stopped its poller, so its futures could only time out)."""
    engine = server.engine
    abandoned = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    stop_abandoned, stop_other = keepalive(server, abandoned, KEY_A), keepalive(server, other, KEY_B)
    try:
        sc = abandoned.create_sampling_client(base_model=BASE).result()
        other_sc = other.create_sampling_client(base_model=BASE).result()
        running, release = hold_engine_once_running(server)
        try:
            first = sc.sample(types.ModelInput.from_ints([3, 4]), 1, LONG)
            assert running.wait(60)  # decoding, with KV, and the engine held
            queued = [sc.sample(types.ModelInput.from_ints([5, 6, i]), 2, LONG) for i in range(3)]
            wait_until(lambda: engine.queue_depth() == 3, "the abandoned session's samples to queue")
            kept = other_sc.sample(types.ModelInput.from_ints([7, 8]), 1, types.SamplingParams(max_tokens=4))
            wait_until(lambda: engine.queue_depth() == 4, "the other session's sample to queue")
            assert metric(server, "mint_kv_blocks_in_use") > 0
            decoded_before = engine.sampler.stats.decode_tokens

            stop_abandoned()
            end_session(abandoned)
            # Its requests end at once, held engine or not (queued work is dropped when the worker
            # reaches it; the running sample stops at the worker's next turn); the other's waits on.
            wait_until(lambda: metric(server, 'mint_queue_depth{queue="sampling"}') == 1,
                       "the abandoned session's requests to end")
        finally:
            release()
            engine.resume()
        assert kept.result(timeout=60).sequences[0].tokens  # the other session is served
        wait_until(lambda: metric(server, "mint_kv_blocks_in_use") == 0, "the KV blocks to be freed")
        assert metric(server, 'mint_queue_depth{queue="sampling"}') == 0
        wait_until(lambda: engine.queue_depth() == 0, "the engine queue to empty")
        # The running sample stopped at once: far fewer tokens than its 200 (plus the kept one's 4).
        assert engine.sampler.stats.decode_tokens - decoded_before < 20
        for future in [first, *queued] if client_polls else []:
            with pytest.raises(Exception):  # noqa: B017 (cancelled, or its sampling session is gone)
                future.result(timeout=60)
    finally:
        stop_abandoned()
        stop_other()
        other.close("success")
        abandoned.close("success")


def test_ending_a_session_cancels_its_samples_and_frees_their_kv(server: LiveServer) -> None:
    abandon_and_check(server, lambda client: client.close("success").result(), client_polls=False)


def test_an_expired_session_cancels_its_samples_and_frees_their_kv(server: LiveServer) -> None:
    """The client stops heartbeating (as a killed one does): the session expires after its TTL."""
    abandon_and_check(server, lambda _client: wait_until(
        lambda: metric(server, "mint_active_sessions") == 1, "the silent session to expire"))
