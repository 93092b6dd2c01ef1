"""Tinker 0.38 features beyond the core loop, end to end: the official SDK against a live server."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.service.live import BASE, KEY_B, LiveServer, train

PROMPT = [5, 6, 7, 8]


def _grads(server: LiveServer, model_id: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    adapter_id = server.service.core.stores.models[model_id].adapter_id
    return server.engine.residency.get(adapter_id).grads


def _rl_datum(seq: types.SampledSequence, advantage: float, explicit: bool) -> types.Datum:
    """A stable_reinforce datum over prompt + sampled tokens: by provenance (the sampler's records
    supply π_sampler) or carrying the sampled logprobs itself."""
    sampled = list(seq.tokens)
    n_prompt_targets = len(PROMPT) - 1
    inputs = {
        "target_tokens": PROMPT[1:] + sampled,
        "advantages": [0.0] * n_prompt_targets + [advantage] * len(sampled),
    }
    d = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + sampled[:-1]), loss_fn_inputs=inputs)
    if explicit:
        logprobs = [0.0] * n_prompt_targets + list(seq.logprobs or [])
        return types.Datum(model_input=d.model_input, loss_fn_inputs={**inputs, "logprobs": logprobs})
    sid = seq.sequence_id
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt_targets),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))],
    )


def test_stability_records_drive_stable_reinforce(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    by_id = client_a.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    explicit = client_a.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=11, stop=[])
    from_training = by_id.save_weights_and_get_sampling_client(record_stability_info=True).result()
    path = by_id.save_weights_for_sampler("s0").result().path
    from_service = client_a.create_sampling_client(model_path=path, record_stability_info=True).result()
    seqs = [*from_training.sample(types.ModelInput.from_ints(PROMPT), 2, params).result().sequences,
            *from_service.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences]
    ids = [s.sequence_id for s in seqs]
    assert len(set(ids)) == 3 and all(ids)
    # The engine recorded each sequence under exactly the id the client was shown.
    for s in seqs:
        rec = server.engine.records.get_record(s.sequence_id)
        assert rec is not None and rec.tokens.tolist() == list(s.tokens)
        assert np.allclose(rec.logprobs, s.logprobs, atol=1e-6)

    advantages = [1.5, -0.5, 0.75]
    out_id = by_id.forward_backward([_rl_datum(s, a, False) for s, a in zip(seqs, advantages, strict=True)],
                                    "stable_reinforce").result()
    out_ex = explicit.forward_backward([_rl_datum(s, a, True) for s, a in zip(seqs, advantages, strict=True)],
                                       "stable_reinforce").result()
    assert out_id.metrics["loss:sum"] == out_ex.metrics["loss:sum"] != 0
    g_id, g_ex = _grads(server, by_id.model_id), _grads(server, explicit.model_id)
    assert g_id.keys() == g_ex.keys()
    for t in g_id:
        assert torch.equal(g_id[t][0], g_ex[t][0]) and torch.equal(g_id[t][1], g_ex[t][1])
    assert any(g[1].abs().max() > 0 for g in g_id.values())

    # An id nobody sampled, and another key's id: 400 naming the id, nothing queued.
    bogus = dataclasses.replace(seqs[0], sequence_id="no-such-sequence")
    with pytest.raises(tinker.BadRequestError, match="no-such-sequence"):
        by_id.forward_backward([_rl_datum(bogus, 1.0, False)], "stable_reinforce").result()
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    tc_b = other.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=ids[0]):
        tc_b.forward_backward([_rl_datum(seqs[0], 1.0, False)], "stable_reinforce").result()
    other.close("success")

    # Expired (records live ttl past their last use): the clock moves past it → 400 naming the id.
    records = server.engine.records
    now = records._clock()
    records._clock = lambda: now + records.ttl_s + 1
    with pytest.raises(tinker.BadRequestError, match=ids[1]):
        by_id.forward_backward([_rl_datum(seqs[1], 1.0, False)], "stable_reinforce").result()


def test_topk_sample_logprobs_come_from_the_same_distribution_as_the_tokens(client_a: tinker.ServiceClient) -> None:
    sc = client_a.create_sampling_client(base_model=BASE).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    seq = sc.sample(types.ModelInput.from_ints([5, 6, 7]), 2, params, topk_sample_logprobs=4).result().sequences[0]
    assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
    for token, logprob, top in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
        assert top is not None and len(top) == 4
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        assert logprob <= values[0] + 1e-6  # nothing beats the most likely token
        for t, lp in top:
            if t == token:
                assert lp == pytest.approx(logprob, abs=1e-6)
    plain = sc.sample(types.ModelInput.from_ints([5, 6, 7]), 2, params).result().sequences[0]
    assert plain.topk_logprobs is None and list(plain.tokens) == list(seq.tokens)  # asking changes no draw


def test_inflight_sampling_reads_the_live_adapter(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints([9, 8, 7])

    def tokens(sc: tinker.SamplingClient) -> list[int]:
        return list(sc.sample(prompt, 1, greedy).result().sequences[0].tokens)

    inflight_a = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot_old = tc.save_weights_and_get_sampling_client().result()
    before = tokens(inflight_a)
    assert tokens(snapshot_old) == before
    # The inflight session holds no copy: it samples on the training model's own slot.
    core = server.service.core
    assert core.stores.samplers[inflight_a._sampling_session_id].live is core.stores.models[tc.model_id]
    loaded_before = len(server.engine.residency)

    train(tc, 3)
    inflight_b = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    fresh = tc.save_weights_and_get_sampling_client().result()
    after = tokens(fresh)
    assert after != before  # the steps changed the greedy continuation
    assert tokens(inflight_a) == after and tokens(inflight_b) == after
    assert tokens(snapshot_old) == before  # a snapshot keeps its weights
    assert inflight_a._sampling_session_id != inflight_b._sampling_session_id  # one session each
    # Two snapshots were loaded (the old and the fresh one); the inflight clients added nothing.
    assert len(server.engine.residency) == loaded_before + 1


# --- server-side custom losses ---------------------------------------------------------------------
def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss}


def clipped_ratio(logprobs, sampling_logprobs, advantages):
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/clip_frac:mean": (ratio != clipped).float().mean(), "custom/ppo:sum": loss}


def mean_logprob(logprobs):
    loss = -logprobs.mean()
    return loss, {"custom/mean_logprob:mean": logprobs.mean(), "custom/tokens:sum": logprobs.shape[0] + 0 * loss}


CUSTOM_LOSSES = [
    (weighted_nll, {"logprobs": 1, "weights": 1}),
    (clipped_ratio, {"logprobs": 1, "sampling_logprobs": 1, "advantages": 1}),
    (mean_logprob, {"logprobs": 1}),
]


def _custom_data() -> list[types.Datum]:
    rows = [[5, 17, 33, 60, 61, 62, 63, 9], [100, 101, 102, 103, 104, 105]]
    out = []
    for k, r in enumerate(rows):
        n = len(r) - 1
        f32 = types.TensorData.from_numpy
        out.append(types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={
            "target_tokens": r[1:],
            "weights": [1.0 - 0.1 * i for i in range(n)],
            "sampling_logprobs": f32(np.array([-3.0 - 0.2 * i for i in range(n)], np.float32)),
            "advantages": f32(np.array([(-1.0) ** (i + k) for i in range(n)], np.float32)),
        }))
    return out


def _adapter_weights(server: LiveServer, model_id: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    adapter_id = server.service.core.stores.models[model_id].adapter_id
    return server.engine.residency.weights(adapter_id).weights


def test_custom_losses_run_on_the_server_like_on_the_client(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    on_server = client_a.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    on_client = client_a.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    data = _custom_data()
    for fn, ranks in CUSTOM_LOSSES:
        handle = client_a.create_custom_loss(fn, ranks).result()
        assert handle.loss_id is not None  # the server advertised custom_loss_server_side: uploaded
        local = dataclasses.replace(handle, loss_id=None)  # the same traced graph, run by the SDK
        passes_before = server.engine.stats["ops"]
        srv = on_server.forward_backward_custom(data, handle).result()
        assert server.engine.stats["ops"] == passes_before + 1  # one engine op, no client round trip
        cli = on_client.forward_backward_custom(data, local).result()
        assert srv.metrics.keys() == cli.metrics.keys(), fn.__name__
        for key in cli.metrics:
            assert srv.metrics[key] == pytest.approx(cli.metrics[key], rel=1e-5, abs=1e-5), (fn.__name__, key)
        on_server.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        on_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        w_srv, w_cli = _adapter_weights(server, on_server.model_id), _adapter_weights(server, on_client.model_id)
        for t in w_cli:
            for a, b in zip(w_srv[t], w_cli[t], strict=True):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (fn.__name__, t)

    # A loss belongs to its session: another session's training client cannot name it.
    other = tinker.ServiceClient(base_url=server.url, api_key=server.settings.api_keys[0])
    tc = other.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="loss_id"):
        tc.forward_backward(data, "custom", {"loss_id": handle.loss_id}).result()
    other.close("success")


def _node(op: str, name: str, target: str, *args: object, **kwargs: object) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def _graph(*middle: dict, out: object = None) -> list[dict]:
    lp = _node("placeholder", "logprobs", "logprobs")
    loss = _node("call_method", "loss", "sum", {"ref": "logprobs"})
    output = _node("output", "output", "output", out or {"tuple": [{"ref": "loss"}, {"dict": {}}]})
    return [lp, *middle, loss, output]


def _hostile_graphs(canary: str) -> dict[str, list[dict]]:
    ref = {"ref": "logprobs"}
    return {
        "os.system": _graph(_node("call_function", "x", "os.system", f"touch {canary}")),
        "subprocess": _graph(_node("call_function", "x", "subprocess.run", ["touch", canary])),
        "__import__": _graph(_node("call_function", "m", "builtins.__import__", "os"),
                             _node("call_method", "x", "system", {"ref": "m"}, f"touch {canary}")),
        "eval": _graph(_node("call_function", "x", "builtins.eval", f"open({canary!r}, 'w')")),
        "exec": _graph(_node("call_function", "x", "exec", f"open({canary!r}, 'w')")),
        "open": _graph(_node("call_function", "x", "builtins.open", canary, "w")),
        "torch.save": _graph(_node("call_function", "x", "torch.save", ref, canary)),
        "methodcaller": _graph(_node("call_function", "f", "operator.methodcaller", "system", f"touch {canary}")),
        "dunder getattr chain": _graph(
            _node("call_function", "c", "getattr", ref, "__class__"),
            _node("call_function", "g", "getattr", {"ref": "c"}, "__init__"),
            _node("call_function", "x", "getattr", {"ref": "g"}, "__globals__")),
        "dunder method": _graph(_node("call_method", "x", "__reduce_ex__", ref, 2)),
        "tensor method outside the list": _graph(_node("call_method", "x", "apply_", ref, "os.system")),
        "get_attr": _graph(_node("get_attr", "x", "os")),
        "call_module": _graph(_node("call_module", "x", "os.system", f"touch {canary}")),
        "torch.hub": _graph(_node("call_function", "x", "torch.hub.load", "evil/repo", "m")),
        "huge graph": _graph(*[_node("call_function", f"n{i}", "torch.exp", ref) for i in range(5000)]),
        "deep arguments": _graph(_node("call_function", "x", "torch.stack", [[[[[[[[[[[ref]]]]]]]]]]])),
        "forward reference": _graph(_node("call_function", "x", "torch.exp", {"ref": "loss"})),
        "device argument": _graph(_node("call_function", "x", "torch.zeros_like", ref, device={"device": "cuda"})),
    }


def test_hostile_custom_loss_graphs_are_refused(server: LiveServer, tmp_path) -> None:
    import httpx

    canary = tmp_path / "canary"
    headers = {"X-API-Key": server.settings.api_keys[0]}
    session_id = httpx.post(f"{server.url}/api/v1/create_session", headers=headers, timeout=30,
                            json={"tags": [], "user_metadata": None, "sdk_version": "test"}).json()["session_id"]

    def create(seq: int, nodes: object, inputs: object = None) -> httpx.Response:
        body = {"session_id": session_id, "custom_loss_seq_id": seq, "name": "evil",
                "inputs": inputs or [{"name": "logprobs", "rank": 1}], "graph": {"nodes": nodes}}
        return httpx.post(f"{server.url}/api/v1/create_custom_loss", headers=headers, json=body, timeout=60)

    hostile = _hostile_graphs(str(canary))
    assert len(hostile) >= 10
    for seq, (label, nodes) in enumerate(hostile.items()):
        r = create(seq, nodes)
        assert r.status_code == 400, (label, r.status_code, r.text)
        assert "detail" in r.json(), label
    # Nesting deeper than any JSON parser stack: still a 400.
    nested = "[" * 100_000 + "]" * 100_000
    deep = f'{{"session_id": "{session_id}", "custom_loss_seq_id": 99, "name": "e", "inputs": [], "graph": {{"nodes": {nested}}}}}'
    r = httpx.post(f"{server.url}/api/v1/create_custom_loss", headers={**headers, "Content-Type": "application/json"},
                   content=deep, timeout=60)
    assert r.status_code == 400, r.text
    assert not canary.exists()
    assert server.service.core.stores.custom_losses == {}

    # Bad-input table for the route: each a 400 naming the field.
    ok_nodes = _graph()
    cases = [
        ("inputs", create(200, ok_nodes, [{"name": "weights", "rank": 1}])),
        ("placeholder", create(201, ok_nodes, [{"name": "logprobs", "rank": 1}, {"name": "w", "rank": 1}])),
        ("metric", create(202, _graph(out={"tuple": [{"ref": "loss"}, {"dict": {"bad key": {"ref": "loss"}}}]}))),
        ("output", create(203, _graph(out={"ref": "loss"}))),
        ("session", httpx.post(f"{server.url}/api/v1/create_custom_loss", headers=headers, timeout=30, json={
            "session_id": "nope", "custom_loss_seq_id": 0, "name": "x", "inputs": [], "graph": {"nodes": []}})),
    ]
    for needle, r in cases:
        assert r.status_code in (400, 404, 410), (needle, r.text)
        assert needle in r.text, (needle, r.text)
    assert create(300, ok_nodes).status_code == 200  # the plain graph itself is fine


# --- Dimuon ----------------------------------------------------------------------------------------
def test_dimuon_trains_resumes_bit_exactly_and_refuses_mixing(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    from tests.service.live import batch

    dimuon = types.DimuonOptimizerConfig()
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4, seed=2, optimizer=dimuon).result()
    assert tc.get_info().optimizer_config.type == "dimuon"
    params = types.DimuonParams(learning_rate=0.1, grad_clip_norm=1.0)

    def step(client: tinker.TrainingClient) -> float:
        loss = client.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"]
        client.optim_step(params).result()
        return loss

    losses = [step(tc) for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses  # the SFT smoke task learns under Dimuon

    state = tc.save_state("dimuon-6").result().path
    resumed = client_a.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.get_info().optimizer_config.type == "dimuon"
    for _ in range(2):
        step(tc)
        step(resumed)
    w_a, w_b = _adapter_weights(server, tc.model_id), _adapter_weights(server, resumed.model_id)
    for t in w_a:
        assert torch.equal(w_a[t][0], w_b[t][0]) and torch.equal(w_a[t][1], w_b[t][1]), t
    moments = server.engine.residency.get(server.service.core.stores.models[resumed.model_id].adapter_id).optim
    assert moments.family == "dimuon" and moments.step == 8

    # Mixing families: a clear 400, both ways, at submission.
    with pytest.raises(tinker.BadRequestError, match="DimuonParams"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    adam = client_a.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="AdamParams"):
        adam.optim_step(params).result()
    with pytest.raises(tinker.BadRequestError, match="optimizer"), pytest.warns(FutureWarning):
        adam.load_state_with_optimizer(state).result()
    # Weights only: a Dimuon checkpoint may start an AdamW run.
    weights_only = client_a.create_training_client_from_state(state).result()
    assert weights_only.get_info().optimizer_config.type == "adamw"


# --- retrieve_futures and cancel -------------------------------------------------------------------
def _wait_until(cond, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_retrieve_futures_and_cancel_round_trip(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    import threading
    import time

    import httpx

    headers = {"X-API-Key": server.settings.api_keys[0]}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/api/v1/{path}", headers=headers, json=body, timeout=60)

    config = post("client/config", {"sdk_version": "0.38.0"}).json()
    assert config["sample_use_retrieve_futures"] and config["custom_loss_server_side"]
    assert post("client/dynamic_config", {"sdk_version": "0.38.0"}).json()["sample_cancel_enabled"]

    sc = client_a.create_sampling_client(base_model=BASE).result()
    sid = sc._sampling_session_id
    # The SDK's own samples complete through the session's completion queue.
    assert sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result().sequences
    cursor_after_sdk = server.service.core.stores.samplers[sid].completions[0].cursor
    assert cursor_after_sdk >= 1

    def asample(seq_id: int, max_tokens: int) -> str:
        r = post("asample", {"sampling_session_id": sid, "seq_id": seq_id, "num_samples": 1,
                             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4]}]},
                             "sampling_params": {"max_tokens": max_tokens, "stop": []}})
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    target = {"sampling_session_id": sid, "cloned_sampler_id": 0}
    done_id = asample(500, 2)
    polled = post("retrieve_futures", {"target": target, "prev_cursor": cursor_after_sdk}).json()
    assert [(c["state"], c["request_id"]) for c in polled["completions"]] == [("finished", done_id)]
    assert post("retrieve_future", {"request_id": done_id}).status_code == 200
    empty = post("retrieve_futures", {"target": target, "prev_cursor": polled["cursor"], "timeout": 0}).json()
    assert empty == {"completions": [], "cursor": polled["cursor"]}

    # Cancel a running sample: hold the batch after a step once the sample holds KV, until the
    # cancel reaches the sampler, so the sample cannot finish first.
    sampler = server.engine.sampler
    step, running = sampler.step, threading.Event()

    def gated_step() -> None:
        step()
        if sampler.kv_blocks_in_use and not running.is_set():
            running.set()
            deadline = time.monotonic() + 60
            while not sampler._cancels and time.monotonic() < deadline:
                time.sleep(0.005)

    sampler.step = gated_step
    try:
        long_id = asample(501, 240)
        assert running.wait(60)
        assert post("cancel_future", {"request_id": long_id}).status_code == 204
        _wait_until(lambda: sampler.kv_blocks_in_use == 0 and not sampler.has_work(), "the KV blocks to be freed")
    finally:
        sampler.step = step
    assert "cancelled" in post("retrieve_future", {"request_id": long_id}).json()["error"]
    polled = post("retrieve_futures", {"target": target, "prev_cursor": empty["cursor"]}).json()
    assert [(c["state"], c["request_id"]) for c in polled["completions"]] == [("failed", long_id)]
    assert sc.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1)).result().sequences

    # Bad input for the new routes: each refused with a 4xx body naming the problem.
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4).result()
    train_request = post("optim_step", {"model_id": tc.model_id, "seq_id": 1,
                                        "adam_params": {"learning_rate": 1e-3}}).json()["request_id"]
    cases = [
        (post("cancel_future", {"request_id": "nope"}), 404, "not found"),
        (post("cancel_future", {"request_id": train_request}), 400, "only samples"),
        (post("cancel_future", {"id": "x"}), 400, "request_id"),
        (post("retrieve_futures", {"target": {"sampling_session_id": "nope"}}), 404, "not found"),
        (post("retrieve_futures", {"target": target, "prev_cursor": -1}), 400, "prev_cursor"),
        (post("retrieve_futures", {"target": target, "timeout": -5}), 400, "timeout"),
        (post("retrieve_futures", {"prev_cursor": 0}), 400, "target"),
    ]
    for r, status, needle in cases:
        assert r.status_code == status and needle in r.text, (needle, r.status_code, r.text)


# --- queue state -----------------------------------------------------------------------------------
def test_queue_state_while_waiting_behind_others(tiny_dir, tmp_path) -> None:
    import httpx

    from tests.service.live import KEY_A, tiny_engine

    with LiveServer(tiny_engine(tiny_dir), tmp_path / "data", long_poll_s=0.2) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        raw_tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
        tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
        states: list[str] = []
        logger = tc._queue_state_logger
        original = logger.on_queue_state_change

        def record(state, reason=None):  # the SDK's queue-state callback, observed
            states.append(state.value if hasattr(state, "value") else str(state))
            return original(state, reason)

        logger.on_queue_state_change = record
        server.engine.pause()  # the engine is busy with others' work: nothing of ours runs yet
        try:
            headers = {"X-API-Key": KEY_A}
            rid = httpx.post(f"{server.url}/api/v1/optim_step", headers=headers, timeout=30, json={
                "model_id": raw_tc.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}).json()["request_id"]
            pending = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            r = httpx.post(f"{server.url}/api/v1/retrieve_future", headers=headers, timeout=30,
                           json={"request_id": rid})
            assert r.status_code == 408, r.text
            body = r.json()
            assert body["type"] == "try_again" and body["request_id"] == rid
            assert body["queue_state"] == "paused_capacity" and body["status"] == "queued"
            assert body["queue_position"] == 0 and body["queue_depth"] >= 1
            assert r.headers["X-Queue-Position"] == "0" and int(r.headers["X-Queue-Depth"]) >= 1
            assert r.headers["Retry-After"] == "1" and r.headers["X-Queue-Status"] == "queued"
            _wait_until(lambda: "paused_capacity" in states, "the SDK's paused queue-state callback")
        finally:
            server.engine.resume()
        assert pending.result().metrics is not None
        assert states[-1] == "active"
        ok = httpx.post(f"{server.url}/api/v1/retrieve_future", headers=headers, timeout=30, json={"request_id": rid})
        assert ok.status_code == 200
        client.close("success")


# --- projects, copy_weights, save_weights_external -------------------------------------------------
def _store_bytes(root) -> int:
    """Bytes on disk under `root`, each file counted once however many links it has."""
    import os

    seen, total = set(), 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def test_projects_and_copy_weights(server: LiveServer) -> None:
    import httpx

    from tests.service.live import KEY_A, KEY_B

    in_proj = tinker.ServiceClient(base_url=server.url, api_key=KEY_A, project_id="proj-a")
    plain = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = in_proj.create_lora_training_client(base_model=BASE, rank=4).result()
    other = plain.create_lora_training_client(base_model=BASE, rank=4).result()
    train(tc, 1)
    state = tc.save_state("s1").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    assert [r.training_run_id for r in rest.list_training_runs(project_id="proj-a").result().training_runs] == [tc.model_id]
    assert {r.training_run_id for r in rest.list_training_runs().result().training_runs} == {tc.model_id, other.model_id}

    runs_root = server.settings.data_dir / "runs"
    before = _store_bytes(runs_root)
    copied = rest.copy_weights(state, "proj-archive", ttl_seconds=7200).result()
    assert copied != state and copied.endswith("/weights/s1")
    assert _store_bytes(runs_root) <= before + 4096  # records only: no checkpoint byte is duplicated
    archived = rest.list_training_runs(project_id="proj-archive").result().training_runs
    assert [r.training_run_id for r in archived] == [copied.split("/")[2]]
    ckpt = rest.list_checkpoints(archived[0].training_run_id).result().checkpoints[0]
    assert ckpt.expires_at is not None and ckpt.size_bytes > 0
    # The copy outlives its source and loads like any checkpoint.
    rest.delete_checkpoint_from_tinker_path(state).result()
    resumed = plain.create_training_client_from_state(copied).result()
    from tests.service.live import batch

    assert resumed.forward(batch(), "cross_entropy").result().metrics["loss:sum"] > 0
    # Ownership: another key cannot copy a private checkpoint of A's, nor see A's projects.
    rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        rest_b.copy_weights(copied, "proj-b").result()
    assert rest_b.list_training_runs(project_id="proj-archive").result().training_runs == []

    # Bad input for the new route: each a 4xx naming the problem.
    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/api/v1/copy_weights", headers={"X-API-Key": KEY_A}, json=body, timeout=30)

    cases = [
        (post({"source_path": copied}), 400, "destination_project_id"),
        (post({"source_path": copied, "destination_project_id": "bad project!"}), 400, "project_id"),
        (post({"source_path": copied, "destination_project_id": "p", "ttl_seconds": 5}), 400, "ttl_seconds"),
        (post({"source_path": "tinker://nope/weights/x", "destination_project_id": "p"}), 400, "run id"),
        (post({"source_path": copied, "destination_project_id": "p", "weights_access_token": "t"}), 400,
         "weights_access_token"),
        (post({"source_path": copied, "session_id": "0" * 32}), 400, "model_seq_id"),
        (post({"destination_project_id": "p"}), 400, "source_path"),
    ]
    for r, status, needle in cases:
        assert r.status_code == status and needle in r.text, (needle, r.status_code, r.text)
    for c in (in_proj, plain):
        c.close("success")


def test_save_weights_external(server: LiveServer) -> None:
    """Exports are checkpoints (tinker://<run>/external_weights/<name>); with recipients every file
    is age-encrypted (`<name>.age`) and decrypts to the plain export's bytes."""
    import httpx
    import pyrage
    import torch as _torch
    from safetensors.torch import load

    from tests.service.live import KEY_A

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train(tc, 1)
    plain = tc.save_weights_external("plain").result().path
    identity = pyrage.x25519.Identity.generate()
    sealed = tc.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())]).result().path
    assert sealed == f"tinker://{tc.model_id}/external_weights/sealed"
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    plain_urls = rest.get_external_weights_urls(plain).result().urls
    sealed_urls = rest.get_external_weights_urls(sealed).result().urls
    assert sealed_urls and all(name.endswith(".age") for name in sealed_urls)
    plain_tensors = load(httpx.get(plain_urls["adapter_model.safetensors"]).content)
    opened = load(pyrage.decrypt(httpx.get(sealed_urls["adapter_model.safetensors.age"]).content, [identity]))
    assert plain_tensors.keys() == opened.keys()
    assert all(_torch.equal(plain_tensors[k], opened[k]) for k in opened)
    for bad in ["../escape", "/abs/path", ".hidden", "a/b"]:
        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="name"):
            tc.save_weights_external(bad).result()
    assert not any("escape" in str(p) for p in (server.settings.data_dir).rglob("*"))
    client.close("success")


def test_a_late_acknowledgement_after_the_session_ended_is_answered_empty(server: LiveServer) -> None:
    """The SDK's poller may send its last acknowledgement (timeout 0) after close() ended the session:
    its own key gets "nothing new" (no 404 for the SDK to log as a polling failure); another key, or
    a poll that waits for results, gets the 404 of any missing session."""
    import httpx

    key_a = server.settings.api_keys[0]
    client = tinker.ServiceClient(base_url=server.url, api_key=key_a)
    sc = client.create_sampling_client(base_model=BASE).result()
    sid = sc._sampling_session_id
    assert sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result().sequences
    client.close("success").result()
    assert sid not in server.service.core.stores.samplers

    def poll(key: str, **extra: object) -> httpx.Response:
        body = {"target": {"sampling_session_id": sid, "cloned_sampler_id": 0}, "prev_cursor": 1,
                "retrieved_request_ids": ["r-1"], **extra}
        return httpx.post(f"{server.url}/api/v1/retrieve_futures", headers={"X-API-Key": key}, json=body, timeout=30)

    late = poll(key_a, timeout=0)
    assert late.status_code == 200 and late.json() == {"completions": [], "cursor": 1}, late.text
    assert poll(KEY_B, timeout=0).status_code == 404
    assert poll(key_a).status_code == 404
