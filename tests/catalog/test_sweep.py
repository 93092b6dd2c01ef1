"""`mint catalog seed --servable` and `mint sweep` on the tiny model, local data dir: real, distinct
adapters; every policy swept once, scores stored as evals, outputs on disk; a second run resumes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mint_server.catalog import Catalog
from tests.catalog.test_cli import MINT, subprocess_env
from tests.tiny import make_tiny_checkpoint


def mint(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([MINT, *args], capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_seed_servable_then_sweep_and_resume(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", tie=True)
    data = tmp_path / "data"
    common = ["--data-dir", str(data), "--owner", "bench"]
    mint("catalog", "seed", "--servable", "--base-model", str(model), "--policies", "12", "--rank", "2",
         "--prefix", "sv-", *common)
    with Catalog.open(data_dir=data) as catalog:
        policies = catalog.list_policies("bench").items
        assert len(policies) == 12 and {p.base_model for p in policies} == {"tiny"}
        shas = {catalog.resolve("bench", f"{p.name}@prod").sha256 for p in policies}
        assert len(shas) == 12  # distinct adapters
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    args = ["sweep", "--policy-prefix", "sv-", "--prompts", str(prompts), "--max-tokens", "4",
            "--base-model", str(model), "--out", str(tmp_path / "out"), *common]
    first = json.loads(mint(*args).stdout.strip().splitlines()[-1])
    assert first == {"swept": 12, "skipped": 0, "failed": 0}
    outputs = {r["policy"]: r for f in (tmp_path / "out").glob("*.json") for r in json.loads(f.read_text())}
    assert len(outputs) == 12 and all(len(o["outputs"]) == 2 for o in outputs.values())
    assert len({o["score"] for o in outputs.values()}) == 12  # different adapters, different logprobs
    with Catalog.open(data_dir=data) as catalog:
        for p in policies:
            (ev,) = catalog.list_evals("bench", f"{p.name}@prod", metric="sweep").items
            assert ev.value == outputs[p.name]["score"]
    again = json.loads(mint(*args).stdout.strip().splitlines()[-1])
    assert again == {"swept": 0, "skipped": 12, "failed": 0}  # resumed: nothing done twice


def test_a_sweep_is_batch_work(tmp_path: Path) -> None:
    """The sweep's requests run in the batch class, behind serving and rollouts on the same engine."""
    import torch

    from mint_server.cli.sweep import run_sweep
    from mint_server.engine.local import LocalEngine
    from mint_server.engine.settings import EngineSettings
    from mint_server.engine.values import Priority

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", tie=True)
    data = tmp_path / "data"
    mint("catalog", "seed", "--servable", "--base-model", str(model), "--policies", "3", "--rank", "2",
         "--prefix", "sv-", "--data-dir", str(data), "--owner", "bench")
    engine = LocalEngine(model, "tiny", device="cpu", dtype=torch.float32,
                         settings=EngineSettings(device_slots=2, max_rank=8, kv_budget_tokens=2048, max_context=128))
    try:
        with Catalog.open(data_dir=data) as catalog:
            done = run_sweep(engine, catalog, "bench", ["hello world"], "sv-", "prod", 2, "m", tmp_path / "out", 2)
        assert done["swept"] == 3
        classes = {p for p, kind, _ in engine.sampler.drain_latencies() if kind == "ttft"}
        assert classes == {Priority.BATCH}
    finally:
        engine.shutdown()
