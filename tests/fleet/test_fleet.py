"""The Ray fleet: two LocalEngine replicas as Ray actors behind FleetEngine, on the tiny model.

One local Ray instance and one fleet serve the whole module (starting Ray costs ~10 s on 2 cores).
The tests drive the real thing: Ray actors, the real service on loopback, the tinker SDK."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from mint_server.api.http.metrics import Metrics
from mint_server.engine.interface import EngineError
from mint_server.engine.settings import FleetSettings
from mint_server.engine.values import AdapterSource
from mint_server.model.config import ModelConfig
from mint_server.model.peft_io import save_peft
from tests.model.test_parity import random_adapter
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer, batch, tiny_engine, train
from tests.tiny import make_tiny_checkpoint

ray = pytest.importorskip("ray", reason="the fleet needs Ray: pip install 'mint-server[fleet]'")

from mint_server.engine.fleet import FleetEngine, HashRing  # noqa: E402 - after the skip

GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
PROMPT = [5, 17, 33, 60]
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)


@pytest.fixture(scope="module")
def fleet(tiny_dir: Path) -> Iterator[FleetEngine]:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=96 * 1024 * 1024, log_to_driver=False)
    engine = FleetEngine(tiny_dir, BASE, settings=ENGINE_SETTINGS, fleet=FleetSettings(replicas=2),
                         device="cpu", dtype="float32")
    try:
        yield engine
    finally:
        engine.shutdown(drain=False)
        ray.shutdown()


class Shared:
    """The module's fleet for one LiveServer: the server's shutdown leaves it running for the next test."""

    def __init__(self, fleet: FleetEngine) -> None:
        self._fleet = fleet

    def __getattr__(self, name: str):
        return getattr(self._fleet, name)

    def shutdown(self, drain: bool = True) -> None:
        pass


def _policies(tiny_dir: Path, tmp: Path, n: int) -> list[AdapterSource]:
    cfg = ModelConfig.from_hf_dir(tiny_dir)
    sources = []
    for i in range(n):
        d = tmp / f"policy-{i}"
        save_peft(random_adapter(cfg, 2, seed=500 + i), d, BASE)
        sources.append(AdapterSource(f"ckpt:{tmp.name}/policy-{i}", peft_dir=d))  # a key per test
    return sources


def _sample(engine, source, seed: int = 0) -> Future:
    params = types.SamplingParams(max_tokens=6, temperature=0.8, seed=seed, stop=[])
    return engine.submit(engine.prepare_sample(source, PROMPT, 1, params))


def test_hash_ring_spreads_keys_and_is_stable() -> None:
    ring = HashRing(2)
    homes = [ring.home(f"rev:{i}") for i in range(1000)]
    assert 400 < homes.count(0) < 600
    assert homes == [HashRing(2).home(f"rev:{i}") for i in range(1000)]  # same in every process


def _openai_session(url: str, policy: str) -> dict[str, Any]:
    """Chat and completions, whole and streamed, on the base and on a catalog revision."""
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0)
    out: dict[str, Any] = {}
    for model in (BASE, f"{policy}@1"):
        kw: dict[str, Any] = dict(model=model, messages=HELLO, max_tokens=12, seed=5, n=2)
        whole = oai.chat.completions.create(**kw)
        out[f"chat {model}"] = {c.index: c.message.content for c in whole.choices}
        out[f"chat stream {model}"] = _collect(oai.chat.completions.create(**kw, stream=True))
        kw = dict(model=model, prompt=PROMPT, max_tokens=10, seed=3, temperature=0.9, logprobs=0,
                  extra_body={"return_tokens_as_token_ids": True})
        choice = oai.completions.create(**kw).choices[0]
        out[f"completion {model}"] = (choice.logprobs.tokens, choice.text)
        out[f"completion stream {model}"] = _collect(oai.completions.create(**kw, stream=True))
    oai.close()
    return out


def _collect(stream: Any) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
    return texts


def test_sdks_through_fleet_match_single_engine(fleet: FleetEngine, tiny_dir: Path, tmp_path: Path) -> None:
    """Train, save, sample a snapshot, a catalog revision and the base with the tinker SDK, and chat
    and complete (whole and streamed) with the openai SDK, through the router and on one engine:
    the same numbers and the same text."""

    def session(engine) -> tuple[list[float], list[list[int]], list[list[int]], dict[str, Any]]:
        with LiveServer(engine, tmp_path / f"data-{id(engine)}") as server:
            client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
            tc = client.create_lora_training_client(BASE, rank=4, seed=7).result()
            losses = train(tc, 3)
            sc = tc.save_weights_and_get_sampling_client().result()
            trained = [list(sc.sample(types.ModelInput.from_ints(PROMPT), 1,
                                      types.SamplingParams(max_tokens=6, temperature=0.9, seed=s, stop=[]))
                            .result().sequences[0].tokens) for s in (1, 2)]
            tc.save_weights_for_sampler("published").result()  # a catalog revision of the run's policy
            policy = tc.model_id.replace(":", "-")
            revision = client.create_sampling_client(model_path=f"tinker://{policy}@1").result()
            trained.append(list(revision.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY)
                                .result().sequences[0].tokens))
            base = client.create_sampling_client(base_model=BASE).result()
            bare = [list(base.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0].tokens)]
            chats = _openai_session(server.url, policy)
            client.close("success")
            return losses, trained, bare, chats

    local = tiny_engine(tiny_dir)
    try:
        want = session(local)
    finally:
        local.shutdown()
    got = session(Shared(fleet))
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    assert got[1] == want[1] and got[2] == want[2]
    chats = got[3]
    for model in (BASE, "@1"):  # streamed text equals whole text, through the router too
        chat = next(k for k in chats if k.startswith("chat ") and k.endswith(model) and "stream" not in k)
        assert chats[chat.replace("chat ", "chat stream ")] == chats[chat] and len(chats[chat]) == 2
        done = next(k for k in chats if k.startswith("completion ") and k.endswith(model) and "stream" not in k)
        assert chats[done.replace("completion ", "completion stream ")] == {0: chats[done][1]}
    assert [v for _k, v in sorted(chats.items())] == [v for _k, v in sorted(want[3].items())]


def test_stream_tokens_and_cancel_cross_the_router(fleet: FleetEngine, tiny_dir: Path, tmp_path: Path) -> None:
    """A streamed sample's tokens arrive through on_token, equal to the result's and to the unstreamed
    sample's; setting its cancel event mid-stream stops it on its replica, which frees its KV."""
    (source,) = _policies(tiny_dir, tmp_path, 1)
    params = types.SamplingParams(max_tokens=8, temperature=0.9, seed=4, stop=[])
    whole = fleet.submit(fleet.prepare_sample(source, PROMPT, 2, params)).result(timeout=120)
    seen: list[tuple[int, int, float, Any]] = []
    job = fleet.prepare_sample(source, PROMPT, 2, params, top_logprobs=2).streaming(
        lambda i, t, lp, top: seen.append((i, t, lp, top)), threading.Event())
    streamed = fleet.submit(job).result(timeout=120)
    for i, seq in enumerate(streamed.sequences):
        assert [t for j, t, _, _ in seen if j == i] == list(seq.tokens) == list(whole.sequences[i].tokens)
        assert [lp for j, _, lp, _ in seen if j == i] == pytest.approx(list(seq.logprobs), abs=1e-6)
        assert all(len(top) == 2 for j, _, _, top in seen if j == i)  # the alternatives cross too

    home = fleet.home_of(source.key)
    cancels = fleet.replica_status(home)["cancels"]
    first, cancel, drawn = threading.Event(), threading.Event(), []
    long = types.SamplingParams(max_tokens=200, temperature=0.9, seed=4, stop=[])
    job = fleet.prepare_sample(source, PROMPT, 1, long).streaming(lambda i, t, lp, top: (drawn.append(t), first.set()),
                                                                  cancel)
    fleet.pause_replica(home, after_tokens=1)  # its worker stops after the first token: no finishing alone
    future = fleet.submit(job)
    assert first.wait(120)
    try:
        cancel.set()
        _wait_for(lambda: fleet.replica_status(home)["cancels"] > cancels)  # the replica got it
        assert fleet.replica_status(home)["kv_blocks_in_use"] > 0
    finally:
        fleet.resume_replica(home)
    with pytest.raises(EngineError, match="cancelled"):
        future.result(timeout=120)
    _wait_for(lambda: fleet.replica_status(home)["kv_blocks_in_use"] == 0)
    assert len(drawn) < 200


def test_openai_client_going_away_frees_the_replicas_kv(fleet: FleetEngine, tmp_path: Path) -> None:
    """The OpenAI face sets a stream's cancel event when its client disconnects: through the
    router, the replica running it stops early and frees its KV."""
    cancels = sum(fleet.replica_status(r)["cancels"] for r in (0, 1))
    decoded = sum(fleet.replica_status(r)["sampler"]["tokens"]["decode"] for r in (0, 1))
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    for replica in (0, 1):  # the one running the stream stops after its first token: no finishing alone
        fleet.pause_replica(replica, after_tokens=1)
    with LiveServer(Shared(fleet), tmp_path / "data") as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as r:
            assert r.status_code == 200
            # Running on a replica, which pauses after its first token: it cannot finish alone.
            _wait_for(lambda: any(fleet.replica_status(i)["kv_blocks_in_use"] > 0 for i in (0, 1)))
        try:
            _wait_for(lambda: sum(fleet.replica_status(r)["cancels"] for r in (0, 1)) > cancels)
        finally:
            for replica in (0, 1):
                fleet.resume_replica(replica)
        _wait_for(lambda: all(fleet.replica_status(r)["kv_blocks_in_use"] == 0 for r in (0, 1)))
    assert sum(fleet.replica_status(r)["sampler"]["tokens"]["decode"] for r in (0, 1)) - decoded < 199


def test_cancel_reaches_an_unstreamed_sample(fleet: FleetEngine, tiny_dir: Path, tmp_path: Path) -> None:
    """engine.cancel (the tinker cancel_future) on a sample running on a replica stops it there."""
    (source,) = _policies(tiny_dir, tmp_path, 1)
    home = fleet.home_of(source.key)
    fleet.pause_replica(home)
    try:
        future = _sample(fleet, source)
        _wait_for(lambda: fleet.replica_status(home)["queue_depth"] > 0)  # it reached the replica
        fleet.cancel(future)
        assert future.cancelled()
        _wait_for(lambda: fleet.replica_status(home)["cancels"] > 0)
    finally:
        fleet.resume_replica(home)
    _wait_for(lambda: fleet.replica_status(home)["kv_blocks_in_use"] == 0 and fleet.queue_depth() == 0)


def _wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_affinity_policies_land_on_their_home(fleet: FleetEngine, tiny_dir: Path, tmp_path: Path) -> None:
    """20 policies × 10 requests: ≥ 90% on the policy's home replica, as /metrics shows."""
    sources = _policies(tiny_dir, tmp_path, 20)
    before = dict(fleet.routed)
    for rnd in range(10):  # rounds of one request per policy, as 20 clients sampling in turn would
        futures = [_sample(fleet, s, seed=rnd) for s in sources]
        for f in futures:
            assert len(f.result(timeout=120).sequences[0].tokens) == 6
    routed = {k: n - before.get(k, 0) for k, n in fleet.routed.items()}
    home = sum(n for (_, d), n in routed.items() if d == "home")
    assert sum(routed.values()) == 200 and home >= 180
    assert {fleet.home_of(s.key) for s in sources} == {0, 1}  # both replicas serve someone
    assert [fleet.replica_status(r)["torch_threads"] for r in (0, 1)] == [1, 1]  # its reserved CPU, not the node's
    metrics = Metrics()
    metrics.watch_engine(fleet)
    text = metrics.render().decode()
    rate = float(re.search(r"^mint_fleet_affinity_hit_rate (\S+)$", text, re.M).group(1))
    assert rate >= 0.9
    assert 'mint_fleet_routed_total{decision="home",replica="0"}' in text
    assert 'mint_fleet_replica_adapters{replica="1",tier="device"}' in text
    assert 'mint_fleet_replica_kv_blocks_in_use{replica="0"} 0.0' in text
    assert re.search(r'^mint_fleet_replica_step_seconds_total\{replica="0",stat="count"\} [1-9]', text, re.M)


def test_a_hot_policy_is_served_by_several_replicas(fleet: FleetEngine, tiny_dir: Path, tmp_path: Path) -> None:
    """When a policy's home has spill_inflight requests in flight, new ones spill to the other
    replica, which serves them while the home is busy; the tokens are the home's."""
    (source,) = _policies(tiny_dir, tmp_path, 1)
    home = fleet.home_of(source.key)
    spill, before = fleet.router.spill_inflight, dict(fleet.routed)
    fleet.router.spill_inflight = 2
    fleet.pause_replica(home)  # the home is busy: what it holds stays in flight
    try:
        futures = [_sample(fleet, source, seed=s) for s in range(8)]
        spilled = fleet.routed[(1 - home, "spill")] - before.get((1 - home, "spill"), 0)
        assert spilled >= 2
        _wait_for(lambda: sum(f.done() for f in futures) >= spilled)  # served while the home is held
    finally:
        fleet.router.spill_inflight = spill
        fleet.resume_replica(home)
    got = [f.result(timeout=120).sequences[0].tokens for f in futures]
    again = [_sample(fleet, source, seed=s) for s in range(8)]  # all at home now (default spill)
    assert [f.result(timeout=120).sequences[0].tokens for f in again] == got


def test_a_cold_wave_spreads_in_proportion_to_free_capacity(fleet: FleetEngine, tiny_dir: Path,
                                                            tmp_path: Path) -> None:
    """A wave of distinct cold adapters goes where free capacity is: with replica 0 already holding
    10 requests, 30 cold adapters split 10 / 20, leaving both equally loaded; each stays home after."""
    sources = _policies(tiny_dir, tmp_path, 40)
    _wait_for(lambda: fleet.queue_depth() == 0)
    # An idle fleet places a key at its hashing home: the first of those on replica 0 is the hot one.
    probed = next(i for i, s in enumerate(sources) if fleet.home_of(s.key) == 0)
    hot, wave = sources[probed], sources[probed + 1:][:30]
    assert len(wave) == 30
    for r in (0, 1):
        fleet.pause_replica(r)  # nothing finishes: in-flight counts are exactly what was routed
    try:
        busy = [_sample(fleet, hot, seed=s) for s in range(10)]
        before = dict(fleet.routed)
        futures = [_sample(fleet, s) for s in wave]
        routed = {k: n - before.get(k, 0) for k, n in fleet.routed.items()}
        assert routed.get((0, "home"), 0) == 10 and routed.get((1, "home"), 0) == 20
    finally:
        for r in (0, 1):
            fleet.resume_replica(r)
    for f in busy + futures:
        assert len(f.result(timeout=120).sequences[0].tokens) == 6
    homes = [fleet.home_of(s.key) for s in wave]
    before = dict(fleet.routed)
    for f in [_sample(fleet, s) for s in wave]:
        f.result(timeout=120)
    assert fleet.routed[(1, "home")] - before.get((1, "home"), 0) == homes.count(1) == 20


def test_first_use_of_revisions_from_many_requests_on_both_replicas(fleet: FleetEngine, tmp_path: Path) -> None:
    """The race of two writers staging one adapter: 4 policies trained and published through the SDK.
    First, 12 first-use samples of one revision at once (a barrier releases them) with both replicas
    held, so that requests spill and its first load happens on both; then 4 first uses of each other
    revision at once. Every request succeeds with its policy's greedy tokens; the shared dir holds
    one copy per revision and no temp dir."""
    from concurrent.futures import ThreadPoolExecutor

    spill, before = fleet.router.spill_inflight, dict(fleet.routed)
    with LiveServer(Shared(fleet), tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        paths = []
        for i in range(4):
            tc = client.create_lora_training_client(BASE, rank=4, seed=20 + i).result()
            train(tc, 1)
            tc.save_weights_for_sampler("published").result()
            paths.append(f"tinker://{tc.model_id.replace(':', '-')}@1")

        def burst(requests: list[str]) -> list[Future]:
            barrier = threading.Barrier(len(requests))

            def first_use(path: str) -> list[int]:
                sampler = client.create_sampling_client(model_path=path).result()
                barrier.wait()
                return list(sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
                            .sequences[0].tokens)

            return [pool.submit(first_use, p) for p in requests]

        with ThreadPoolExecutor(12) as pool:
            fleet.router.spill_inflight = 1
            for r in (0, 1):
                fleet.pause_replica(r)
            try:
                held = burst([paths[0]] * 12)
                _wait_for(lambda: sum(fleet.routed.values()) - sum(before.values()) >= 12)
                routed = {k: n - before.get(k, 0) for k, n in fleet.routed.items() if n != before.get(k, 0)}
            finally:
                fleet.router.spill_inflight = spill
                for r in (0, 1):
                    fleet.resume_replica(r)
            first = [f.result(timeout=180) for f in held]
            rest = [f.result(timeout=180) for f in burst([p for p in paths[1:] for _ in range(4)])]
        client.close("success")
    # one revision's first use from both replicas at once: its home took some, the other the spill
    assert {r for r, _decision in routed} == {0, 1} and any(d == "spill" for _r, d in routed)
    assert all(t == first[0] for t in first) and len(first[0]) == GREEDY.max_tokens
    for i in range(0, len(rest), 4):  # each policy's four answers agree
        assert rest[i] == rest[i + 1] == rest[i + 2] == rest[i + 3] and len(rest[i]) == GREEDY.max_tokens
    shared = fleet.placements.shared
    assert not [p.name for p in shared.iterdir() if p.name.startswith(".")]


def test_kill_a_replica_mid_load(fleet: FleetEngine, tiny_dir: Path, tmp_path: Path) -> None:
    """Samples in flight on the dead replica are retried elsewhere (same seed, same tokens); its
    training client gets a retryable error, then resumes from its last saved state."""
    sources = _policies(tiny_dir, tmp_path, 8)
    expected = [f.result(timeout=120).sequences[0].tokens for f in [_sample(fleet, s, seed=3) for s in sources]]
    with LiveServer(Shared(fleet), tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(BASE, rank=4, seed=11).result()
        train(tc, 2)
        tc.save_state("two-steps").result()
        resumed_loss = tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # live progress, never saved: lost
        model = server.service.core.stores.models[tc.model_id]
        victim = fleet.replica_of(model.adapter_id)
        pid = fleet.replica_pids()[victim]

        retried = fleet.affinity().get("retry", 0)
        fleet.pause_replica(victim)  # hold its work, so that some is surely in flight when it dies
        load = [_sample(fleet, s, seed=3) for s in sources * 3]
        streamed = next(i for i, s in enumerate(sources) if fleet.home_of(s.key) == victim)
        drawn: list[int] = []
        params = types.SamplingParams(max_tokens=6, temperature=0.8, seed=3, stop=[])
        stream = fleet.submit(fleet.prepare_sample(sources[streamed], PROMPT, 1, params)
                              .streaming(lambda _i, t, _lp, _top: drawn.append(t), threading.Event()))
        on_victim = sum(1 for s in sources * 3 if fleet.home_of(s.key) == victim)
        assert on_victim > 0
        fleet.kill_replica(victim)
        assert [f.result(timeout=180).sequences[0].tokens for f in load] == expected * 3
        assert stream.result(timeout=180).sequences[0].tokens == expected[streamed] == drawn  # each token once
        assert fleet.affinity()["retry"] - retried >= on_victim

        with pytest.raises(tinker.RequestFailedError, match="replica"):
            tc.forward_backward(batch(), "cross_entropy").result()
        again = tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"]
        assert again == pytest.approx(resumed_loss, abs=1e-5)  # the saved state, not the lost step
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        client.close("success")
    assert fleet.wait_up(120)
    assert fleet.replica_pids()[victim] != pid
    text = Metrics()
    text.watch_engine(fleet)
    assert re.search(rf'^mint_fleet_replica_restarts_total\{{replica="{victim}"\}} 1', text.render().decode(), re.M)


def test_serve_refuses_a_bad_replica_count(tiny_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_server.cli import app

    result = CliRunner().invoke(app, ["serve", "--no-auth", "--base-model", str(tiny_dir), "--data-dir",
                                      str(tmp_path), "--ray", "local", "--replicas", "0"])
    assert result.exit_code != 0 and "--replicas" in result.output
