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
