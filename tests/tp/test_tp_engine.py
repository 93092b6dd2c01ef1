"""A tensor-parallel LocalEngine (tp=2: this process is rank 0, one spawned gloo follower) against the
same work on tp=1: training losses, optimizer steps, saved / exported / paged state and sampled
tokens agree, and state moves between the two in the ordinary unsplit layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from mint_server.engine.custom_loss import compile_loss
from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings
from tests.engine.test_training import sft_datums
from tests.tiny import make_tiny_checkpoint

ADAM = types.AdamParams(learning_rate=1e-2, grad_clip_norm=0.5)  # clipping reads the global gradient norm
TOL = 1e-5


def _custom_loss(logprobs: torch.Tensor) -> tuple[torch.Tensor, dict]:
    return -(logprobs * 0.5).sum() + torch.nn.functional.softplus(logprobs).mean(), {}


_traced = trace_loss(_custom_loss, {"logprobs": 1}, "tp-custom")
CUSTOM = compile_loss(_traced.name, [(i.name, i.rank) for i in _traced.inputs], encode_graph(_traced).nodes)
SEEDS = (1, 2, 3)


def engine(model_dir: Path, tmp_path: Path, tp: int, slots: int, host_cache_mb: float = 64.0,
           tp_timeout_s: float = 300.0) -> LocalEngine:
    s = EngineSettings(device_slots=slots, host_cache_mb=host_cache_mb, max_rank=8, kv_budget_tokens=2048, max_context=256, threads=1,
                       store_dir=tmp_path / f"pages-tp{tp}", tp=tp, tp_timeout_s=tp_timeout_s)
    return LocalEngine(model_dir, "tiny", device="cpu", dtype=torch.float32, settings=s)


def clients(e: LocalEngine, seeds: tuple[int, ...], root: Path, steps: int = 3) -> list[dict]:
    """One training client per seed, their calls interleaved: create → steps × (forward_backward,
    optim_step), save after the first and resume from it before the last, export; then sample
    greedy and seeded from each trained adapter."""
    ids = {s: e.create_adapter(types.LoraConfig(rank=4, seed=s)).result() for s in seeds}
    out = {s: {"losses": [], "norms": []} for s in seeds}
    for step in range(steps):
        # alternate the order, so an adapter is sometimes still in the host tier when next needed
        for s, aid in (list(ids.items()) if step % 2 == 0 else list(ids.items())[::-1]):
            data, d = sft_datums([6, 9], seed=100 + s), root / f"{s}"
            if step == steps - 1:
                e.load_state(aid, d / "state", True).result()
            out[s]["losses"].append(e.submit(e.prepare_train(data, "cross_entropy", None).on(aid)).result()
                                    .metrics["loss:sum"])
            out[s]["norms"].append(e.submit(e.prepare_optim(ADAM).on(aid)).result().metrics["grad_norm:mean"])
            if step == 0:
                e.save_state(aid, d / "state", True).result()
    # a server-side custom loss (two passes through the split trainer, the loss itself on rank 0)
    first = ids[seeds[0]]
    custom = e.submit(e.prepare_custom(sft_datums([7], seed=9), CUSTOM).on(first)).result()
    out[seeds[0]]["losses"].append(custom.metrics["loss:sum"])
    out[seeds[0]]["norms"].append(e.submit(e.prepare_optim(ADAM).on(first)).result().metrics["grad_norm:mean"])
    prompt = [5, 9, 13, 40, 7]
    for s, aid in ids.items():
        e.export_peft(aid, root / f"{s}" / "peft").result()
        e.save_state(aid, root / f"{s}" / "final", True).result()
        greedy = e.submit(e.prepare_sample(aid, prompt, 2, types.SamplingParams(max_tokens=8, temperature=0.0)))
        seeded = e.submit(e.prepare_sample(aid, prompt, 2, types.SamplingParams(max_tokens=8, temperature=1.0,
                                                                                seed=7)))
        out[s]["tokens"] = [list(q.tokens) for r in (greedy.result(), seeded.result()) for q in r.sequences]
        out[s]["scores"] = e.submit(e.prepare_score(aid, prompt + out[s]["tokens"][0])).result()
    # an interpolation (its source gathered, the result installed split) samples alike too
    mixed = e.interpolate([ids[seeds[0]]], [0.5]).result()  # (one source: the tp=2 engine has one slot)
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    out[seeds[0]]["mixed"] = list(e.submit(e.prepare_sample(mixed, prompt, 1, params)).result().sequences[0].tokens)
    return [out[s] for s in seeds]


def dimuon_client(e: LocalEngine) -> list[float]:
    """A Dimuon-trained adapter (its matrix sign over split factors): losses and gradient norms."""
    aid = e.create_adapter(types.LoraConfig(rank=4, seed=5), optimizer="dimuon").result()
    data = sft_datums([8], seed=55)
    out = []
    for _ in range(3):
        out.append(e.submit(e.prepare_train(data, "cross_entropy", None).on(aid)).result().metrics["loss:sum"])
        params = types.DimuonParams(learning_rate=1e-2)
        out.append(e.submit(e.prepare_optim(params).on(aid)).result().metrics["grad_norm:mean"])
    return out


def kl_client(e: LocalEngine) -> list[float]:
    """Reverse KL against the base (full-vocabulary distributions over gathered logits): losses, norms."""
    aid = e.create_adapter(types.LoraConfig(rank=4, seed=6)).result()
    datum = {"student_input": types.ModelInput.from_ints([4, 8, 15, 16, 23]),
             "reference_input": types.ModelInput.from_ints([3, 4, 8, 15, 16, 23]),
             "target_tokens": [8, 15, 16, 23, 42], "weights": [1.0, 0.5, 1.0, 1.0, 2.0]}
    e.submit(e.prepare_train(sft_datums([6], seed=66), "cross_entropy", None).on(aid)).result()
    e.submit(e.prepare_optim(ADAM).on(aid)).result()  # the student now differs from the base
    out = []
    for _ in range(2):
        out.append(e.submit(e.prepare_reverse_kl([datum], 1.5).on(aid)).result().metrics["loss:sum"])
        out.append(e.submit(e.prepare_optim(ADAM).on(aid)).result().metrics["grad_norm:mean"])
    return out


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_tp2_engine_trains_pages_saves_and_samples_like_tp1(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "model", "qwen3", tie=False)
    one = engine(model_dir, tmp_path, tp=1, slots=4)
    try:
        want = clients(one, SEEDS, tmp_path / "tp1")
        dimuon_one = dimuon_client(one)
        kl_one = kl_client(one)
    finally:
        one.shutdown()
    # one device slot and host room for about one more for three clients: every switch pages a
    # client's split state out to the host tier (each rank its share) or on to the store (gathered)
    two = engine(model_dir, tmp_path, tp=2, slots=1, host_cache_mb=0.13)
    try:
        assert two.runner is not None and two.residency.bank.shapes["q_proj"][2] * 2 == \
            two.residency.bank.full_shapes["q_proj"][2]  # rank 0 holds half of q_proj's LoRA B
        got = clients(two, SEEDS, tmp_path / "tp2")
        assert two.residency.stats.evictions["device"] >= 6 and two.residency.stats.evictions["host"] >= 2 \
            and two.residency.stats.loads["host"] > two.residency.stats.loads["store"] + len(SEEDS)
        # tp=1's saved state loads into the split engine (scattered), and trains on identically
        aid = two.load_state(None, tmp_path / "tp1" / "1" / "final", True).result()
        data = sft_datums([6, 9], seed=101)
        loss_after = two.submit(two.prepare_train(data, "cross_entropy", None).on(aid)).result().metrics["loss:sum"]
        dimuon_two = dimuon_client(two)
        kl_two = kl_client(two)
    finally:
        two.shutdown()
    assert min(kl_one) > 0, kl_one
    for a, b in zip(dimuon_one + kl_one, dimuon_two + kl_two, strict=True):
        assert abs(a - b) <= TOL * max(1.0, abs(a)), (dimuon_one, dimuon_two, kl_one, kl_two)
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w["losses"] + w["norms"], g["losses"] + g["norms"], strict=True):
            assert abs(a - b) <= TOL * max(1.0, abs(a)), (w, g)
        assert g["tokens"] == w["tokens"] and g.get("mixed") == w.get("mixed")
        assert g["scores"][0] is None and w["scores"][0] is None
        assert max(abs(a - b) for a, b in zip(g["scores"][1:], w["scores"][1:], strict=True)) <= TOL
    for seed in SEEDS:
        a, b = tmp_path / "tp1" / f"{seed}", tmp_path / "tp2" / f"{seed}"
        # the same files, keys, shapes and dtypes (the unsplit PEFT / state layout), values within TOL
        assert sorted(p.name for p in (a / "peft").iterdir()) == sorted(p.name for p in (b / "peft").iterdir())
        assert (a / "peft" / "adapter_config.json").read_text() == (b / "peft" / "adapter_config.json").read_text()
        assert close(load_file(a / "peft" / "adapter_model.safetensors"),
                     load_file(b / "peft" / "adapter_model.safetensors")) <= TOL
        for name in ("weights.safetensors", "optimizer.safetensors"):
            assert close(load_file(a / "final" / name), load_file(b / "final" / name)) <= TOL
    # tp=2's saved state loads into a tp=1 engine and gives tp=2's next loss
    back = engine(model_dir, tmp_path / "back", tp=1, slots=2)
    try:
        aid = back.load_state(None, tmp_path / "tp2" / "1" / "final", True).result()
        loss_back = back.submit(back.prepare_train(data, "cross_entropy", None).on(aid)).result().metrics["loss:sum"]
    finally:
        back.shutdown()
    assert abs(loss_back - loss_after) <= TOL * max(1.0, abs(loss_back))


def test_a_dead_follower_fails_work_at_once_and_every_later_call(tmp_path: Path) -> None:
    """SIGKILL rank 1: the next op fails with EngineFailed naming the rank (not a hang, not a raw gloo
    error), and so does all later work, sampling included, without touching the broken group."""
    import os
    import signal

    from mint_server.engine.interface import EngineFailed

    model_dir = make_tiny_checkpoint(tmp_path / "m", family="llama", tie=True)
    e = engine(model_dir, tmp_path, tp=2, slots=2)
    try:
        aid = e.create_adapter(types.LoraConfig(rank=2)).result(timeout=120)
        follower = e.runner.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=60)
        job = e.prepare_train(sft_datums([5], seed=1), "cross_entropy", None).on(aid)
        for work in (job, job, e.prepare_sample(None, [1, 2, 3], 1, types.SamplingParams(max_tokens=4))):
            with pytest.raises(EngineFailed, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
                e.submit(work).result(timeout=120)  # the timeout only guards against the old hang
    finally:
        e.shutdown(drain=False)


def test_a_hung_follower_fails_the_op_it_holds_and_idle_ranks_never_time_out(tmp_path: Path) -> None:
    """Rank 1 alive but stopped (SIGSTOP): the op fails with EngineFailed once tp_timeout_s passes,
    never a hang, and later work fails at once. Before that, ranks idle for longer than the timeout
    still run the next op: the limit bounds collectives, not the wait for work."""
    import os
    import signal
    import time

    from mint_server.engine.interface import EngineFailed

    timeout_s = 3.0
    model_dir = make_tiny_checkpoint(tmp_path / "m", family="llama", tie=True)
    e = engine(model_dir, tmp_path, tp=2, slots=2, tp_timeout_s=timeout_s)
    follower = e.runner.followers[0]
    try:
        aid = e.create_adapter(types.LoraConfig(rank=2)).result(timeout=120)
        job = e.prepare_train(sft_datums([5], seed=1), "cross_entropy", None).on(aid)
        time.sleep(2 * timeout_s)  # idle past the collective timeout (a bound, not a measurement)
        e.submit(job).result(timeout=120)
        os.kill(follower.pid, signal.SIGSTOP)
        with pytest.raises(EngineFailed, match="did not complete on every rank"):
            e.submit(job).result(timeout=120)  # the timeout only guards against the old hang
        with pytest.raises(EngineFailed, match="did not complete on every rank"):
            e.submit(e.prepare_sample(None, [1, 2, 3], 1, types.SamplingParams(max_tokens=4))).result(timeout=30)
    finally:
        os.kill(follower.pid, signal.SIGKILL)
        e.shutdown(drain=False)


@pytest.mark.slow
def test_tp2_engine_on_an_mla_base_trains_and_samples_like_tp1(tmp_path: Path) -> None:
    """A DeepSeek-V3.2 base (MLA + DSA + shared experts) in a tp=2 LocalEngine: training losses, gradient
    norms, greedy and seeded tokens and prompt scores as at tp=1 (the latent cache replicated on each rank)."""
    from tests.mla.tiny_deepseek import make_tiny_deepseek

    model_dir = make_tiny_deepseek(tmp_path / "v32", "v32", seed=2)

    def run(tp: int) -> dict:
        e = engine(model_dir, tmp_path, tp=tp, slots=2)
        try:
            aid = e.create_adapter(types.LoraConfig(rank=4, seed=1)).result()
            out: dict = {"losses": [], "norms": []}
            for step in range(2):
                data = sft_datums([7, 5], seed=10 + step)
                out["losses"].append(e.submit(e.prepare_train(data, "cross_entropy", None).on(aid)).result()
                                     .metrics["loss:sum"])
                out["norms"].append(e.submit(e.prepare_optim(ADAM).on(aid)).result().metrics["grad_norm:mean"])
            prompt = [5, 9, 13, 40, 7, 11, 3, 8, 21]
            greedy = e.submit(e.prepare_sample(aid, prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0)))
            seeded = e.submit(e.prepare_sample(aid, prompt, 2, types.SamplingParams(max_tokens=8, temperature=1.0,
                                                                                    seed=7)))
            out["tokens"] = [list(q.tokens) for r in (greedy.result(), seeded.result()) for q in r.sequences]
            out["scores"] = e.submit(e.prepare_score(aid, prompt + out["tokens"][0])).result()
            return out
        finally:
            e.shutdown()

    want, got = run(1), run(2)
    for a, b in zip(want["losses"] + want["norms"], got["losses"] + got["norms"], strict=True):
        assert abs(a - b) <= TOL * max(1.0, abs(a)), (want, got)
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["scores"][1:], want["scores"][1:], strict=True)) <= TOL
