"""Tiered residency on the real LocalEngine: more adapters than device slots and host cache, with
every result equal to the same work run alone on an engine with room for everything."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from tinker import types

from mint_server.engine.interface import EngineError
from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings
from mint_server.engine.values import AdapterSource, Priority
from mint_server.model.peft_io import save_peft
from tests.engine.test_training import sft_datums
from tests.model.test_parity import random_adapter

ADAM = types.AdamParams(learning_rate=1e-2)
GREEDY = dict(temperature=0.0, stop=[])


def engine(model_dir, tmp_path, slots: int, host_adapters: float = 1e6, **kw) -> LocalEngine:
    # A rank-4 adapter on all targets of the tiny model, with AdamW moments and gradients, is
    # ~0.1 MiB: host_adapters scales the host cache in those units.
    s = EngineSettings(device_slots=slots, host_cache_mb=0.1 * host_adapters, max_rank=8, kv_budget_tokens=4096,
                       max_context=256, store_dir=tmp_path / f"pages-{slots}", **kw)
    return LocalEngine(model_dir, "tiny", device="cpu", dtype=torch.float32, settings=s)


def client_run(e: LocalEngine, seed: int, state_dir, steps: int = 3) -> tuple[list[float], dict]:
    """One training client: create, `steps` × (forward_backward, optim_step), save_state after the
    first step, resume from it before the last one; its losses and final weights."""
    aid = e.create_adapter(types.LoraConfig(rank=4, seed=seed)).result()
    data = sft_datums([6, 9], seed=100 + seed)
    losses = []
    for step in range(steps):
        if step == steps - 1:
            e.load_state(aid, state_dir, True).result()
        job = e.prepare_train(data, "cross_entropy", None).on(aid)
        losses.append(e.submit(job).result().metrics["loss:sum"])
        e.submit(e.prepare_optim(ADAM).on(aid)).result()
        if step == 0:
            e.save_state(aid, state_dir, True).result()
    e.submit(e.prepare_train(data, "cross_entropy", None).on(aid)).result()  # pending grads: paged too
    dest = state_dir.parent / f"final-{seed}"
    e.export_peft(aid, dest).result()
    from mint_server.model.peft_io import load_peft

    return losses, load_peft(dest, e.model.config.num_layers).weights


def test_24_training_clients_on_4_slots_equal_each_alone(train_llama_dir, tmp_path):
    n = 24
    alone = engine(train_llama_dir, tmp_path, slots=32)
    try:
        expected = [client_run(alone, i, tmp_path / f"alone-{i}" / "state") for i in range(n)]
    finally:
        alone.shutdown()
    busy = engine(train_llama_dir, tmp_path, slots=4, host_adapters=6)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = client_run(busy, i, tmp_path / f"busy-{i}" / "state")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        stats = busy.residency.stats
    finally:
        busy.shutdown()
    assert not errors, errors[0]
    for (exp_losses, exp_w), (got_losses, got_w) in zip(expected, results, strict=True):
        assert got_losses == pytest.approx(exp_losses, abs=1e-6, rel=1e-6)
        for t, (a, b) in exp_w.items():
            assert torch.allclose(got_w[t][0], a, atol=1e-6) and torch.allclose(got_w[t][1], b, atol=1e-6)
    # the working set really moved: slots were evicted, and adapters went to the store and came back
    assert stats.evictions["device"] > 0 and stats.evictions["host"] > 0 and stats.loads["store"] > 0


def _peft_dirs(cfg, tmp_path, n: int) -> list:
    dirs = []
    for i in range(n):
        d = tmp_path / "revs" / f"r{i}"
        save_peft(random_adapter(cfg, 2, seed=1000 + i), d, "tiny")
        dirs.append(d)
    return dirs


def _sample(e: LocalEngine, source, prompt, max_tokens: int = 8, key: str = "",
            priority: Priority = Priority.ROLLOUT) -> Future:
    params = types.SamplingParams(max_tokens=max_tokens, **GREEDY)
    return e.submit(e.prepare_sample(source, prompt, 1, params, key=key, priority=priority))


def _peft_read(path, reads: list[str], name: str, gate: threading.Event | None = None,
               started: threading.Event | None = None):
    """AdapterSource.read for a PEFT dir that logs the order of store reads (and may wait on a gate)."""
    def read() -> dict[str, bytes]:
        reads.append(name)
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(timeout=120)
        return {f: (path / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}
    return read


def test_200_revisions_on_4_slots_each_equal_alone(sampling_llama_dir, tmp_path):
    roomy = engine(sampling_llama_dir, tmp_path, slots=32)
    dirs = _peft_dirs(roomy.model.config, tmp_path, 200)
    prompts = [[5 + i % 7, 40 + i % 13, 7] for i in range(200)]
    try:
        expected = []
        for i, d in enumerate(dirs):  # one at a time: each alone
            src = AdapterSource(f"r{i}", peft_dir=d)
            expected.append(_sample(roomy, src, prompts[i]).result().sequences[0].tokens)
    finally:
        roomy.shutdown()
    tight = engine(sampling_llama_dir, tmp_path, slots=4, host_adapters=10)
    try:
        futures = [_sample(tight, AdapterSource(f"r{i}", peft_dir=d), prompts[i]) for i, d in enumerate(dirs)]
        got = [f.result(timeout=600).sequences[0].tokens for f in futures]
        stats = tight.residency.stats
    finally:
        tight.shutdown()
    assert got == expected
    assert stats.loads["store"] >= 200 and stats.evictions["device"] >= 196


def test_a_long_sample_keeps_its_slot_through_a_storm_of_loads(sampling_llama_dir, tmp_path):
    quiet = engine(sampling_llama_dir, tmp_path, slots=4)
    dirs = _peft_dirs(quiet.model.config, tmp_path, 41)
    hot = AdapterSource("hot", peft_dir=dirs[0])
    try:
        reference = _sample(quiet, hot, [9, 8, 7], max_tokens=120).result().sequences[0].tokens
    finally:
        quiet.shutdown()
    stormy = engine(sampling_llama_dir, tmp_path, slots=4, host_adapters=3)
    try:
        stormy.pause()  # the long sample and the storm arrive together
        long = _sample(stormy, hot, [9, 8, 7], max_tokens=120)
        storm = [_sample(stormy, AdapterSource(f"c{i}", peft_dir=d), [5, 6], max_tokens=3)
                 for i, d in enumerate(dirs[1:])]
        stormy.resume()
        assert all(len(f.result(timeout=600).sequences[0].tokens) == 3 for f in storm)
        assert long.result(timeout=600).sequences[0].tokens == reference
        assert stormy.residency.stats.evictions["device"] >= 37  # the other three slots churned
    finally:
        stormy.shutdown()


def test_a_corrupt_adapter_fails_its_requests_and_nothing_else(sampling_llama_dir, tmp_path):
    e = engine(sampling_llama_dir, tmp_path, slots=2)
    dirs = _peft_dirs(e.model.config, tmp_path, 2)
    (dirs[1] / "adapter_model.safetensors").write_bytes(b"not safetensors")
    try:
        bad = _sample(e, AdapterSource("bad", peft_dir=dirs[1]), [5, 6])
        good = _sample(e, AdapterSource("good", peft_dir=dirs[0]), [5, 6])
        with pytest.raises(Exception, match="bad|safetensors|header"):
            bad.result(timeout=120)
        assert len(good.result(timeout=120).sequences[0].tokens) == 8
    finally:
        e.shutdown()


def test_an_op_needing_more_adapters_than_slots_is_refused_not_stuck(train_llama_dir, tmp_path):
    e = engine(train_llama_dir, tmp_path, slots=1)
    try:
        a, b = (e.create_adapter(types.LoraConfig(rank=4, seed=s)).result() for s in (1, 2))
        with pytest.raises(EngineError, match="device-slots"):
            e.interpolate([a, b], [0.5, 0.5])
        assert e.residency.get(e.interpolate([a, a], [0.5, 0.5]).result()) is not None  # one adapter: fine
    finally:
        e.shutdown()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_cold_loads_run_below_the_steps_priority(sampling_llama_dir, tmp_path):
    """A burst of cold loads must not take the cores from running streams: the store reads run on
    loader threads `loader_nice` below the engine's priority (the engine thread keeps its own)."""
    e = engine(sampling_llama_dir, tmp_path, slots=2, loader_nice=7)
    dirs = _peft_dirs(e.model.config, tmp_path, 1)
    seen: list[tuple[int, int]] = []

    def read() -> dict[str, bytes]:  # runs on the loader thread that serves this load
        tid = threading.get_native_id()
        seen.append((os.getpriority(os.PRIO_PROCESS, tid), os.getpriority(os.PRIO_PROCESS, os.getpid())))
        return {name: (dirs[0] / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")}

    try:
        out = _sample(e, AdapterSource("cold", read=read), [5, 6]).result(timeout=120)
        assert len(out.sequences[0].tokens) == 8
        (loader, process), = seen
        assert loader == min(19, process + 7)
    finally:
        e.shutdown()


def _load_queued(e, source_key: str) -> bool:
    with e.residency._queued_lock:
        return any(a.source is not None and a.source.key == source_key for a in e.residency._queued)


def test_a_quiet_cold_load_is_not_queued_behind_a_sweeps_prefetch(sampling_llama_dir, tmp_path):
    """Loads start most urgent first and only a few at a time: an interactive request's cold adapter
    arriving while a batch sweep has 20 cold adapters waiting is read right after the loads already
    in flight, not after the sweep's (a loader pool runs what it was handed in order)."""
    e = engine(sampling_llama_dir, tmp_path, slots=2, loader_threads=1)
    dirs = _peft_dirs(e.model.config, tmp_path, 21)
    reads: list[str] = []
    gate, started = threading.Event(), threading.Event()
    try:
        sweep = [_sample(e, AdapterSource(f"s{i}", read=_peft_read(d, reads, f"s{i}", *((gate, started) if i == 0 else ()))),
                         [5, 6], max_tokens=2, key="sweep", priority=Priority.BATCH)
                 for i, d in enumerate(dirs[:20])]
        assert started.wait(timeout=120)  # the first sweep load holds the one loader thread at the gate
        quiet = _sample(e, AdapterSource("quiet", read=_peft_read(dirs[20], reads, "quiet")), [5, 6],
                        key="quiet", priority=Priority.INTERACTIVE)
        # the gate opens once the worker has queued the quiet load (else the loader thread may read
        # the sweep's next ones before the worker's turn sees the new request: a race, not the rule)
        deadline = time.monotonic() + 120
        while not _load_queued(e, "quiet"):
            assert time.monotonic() < deadline, "the quiet load was never queued"
            time.sleep(0.005)
        gate.set()
        assert len(quiet.result(timeout=300).sequences[0].tokens) == 8
        assert all(len(f.result(timeout=300).sequences[0].tokens) == 2 for f in sweep)
        # in flight when it arrived: at most 2 × loader_threads sweep loads; then the quiet one
        assert reads.index("quiet") <= 2, reads
    finally:
        gate.set()
        e.shutdown()
