"""Evals that compare revisions: `mint eval A B … --dataset --metric` locally (its own engine on the
data dir's catalog) and against a server (`POST /api/v1/mint/evals`), on the tiny model's real
revisions; scores follow the outputs, land as eval records, and stay within the tenant."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import tinker
from typer.testing import CliRunner

from mint_server.api.catalog.evals import Example, correct, dataset_id, examples_from
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog import Catalog
from mint_server.catalog.seed import DIGITS
from mint_server.cli import app as mint_app
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, datum, train

PROMPT, TARGET = "hello world", " the quick brown fox"
ROWS = [{"prompt": PROMPT, "target": TARGET}, {"prompt": "1 2 3", "answer": " 4 5"}]


def mint(*args: str) -> str:
    result = CliRunner().invoke(mint_app, list(args))
    assert result.exit_code == 0, f"mint {' '.join(args)}: {result.output}"
    return result.output


def test_metrics_and_dataset_checks() -> None:
    assert correct("exact_match", "  42\n", "42") and not correct("exact_match", "42!", "42")
    assert correct("contains", "the answer is 42.", " 42") and not correct("contains", "4 2", "42")
    assert correct("regex", "x = 42", r"\b42\b") and not correct("regex", "420", r"\b42\b")
    for rows, message in (([], "no examples"), ([{"prompt": "p"}], r"dataset\[0\]: needs"),
                          ([{"prompt": "", "target": "t"}], r"dataset\[0\]: must be"),
                          ([{"prompt": "p", "target": "("}], r"dataset\[0\]\.target: not a regular expression")):
        with pytest.raises(InvalidInput, match=message):
            examples_from(rows, "regex")
    a = dataset_id("arith", [Example("1+1", "2")])
    assert a == dataset_id("arith", [Example("1+1", "2")]) != dataset_id("arith", [Example("1+1", "3")])


def two_revisions(server: LiveServer) -> str:
    """Policy `ev` of tenant A: @1 untrained, @2 trained on PROMPT → TARGET. Returns the run id."""
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(BASE, rank=4, user_metadata={"policy": "ev"}).result()
    tc.save_weights_for_sampler("untrained").result()
    tok = server.engine.tokenizer
    ids = tok(PROMPT)["input_ids"] + tok(TARGET, add_special_tokens=False)["input_ids"]
    train(tc, 4, [datum(ids)])
    tc.save_weights_for_sampler("trained").result()
    client.close("success")
    return tc.model_id


def test_eval_over_http_and_from_the_cli(server: LiveServer, tmp_path: Path) -> None:
    two_revisions(server)
    data = tmp_path / "trained.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n")
    # The CLI against the server: side by side, recorded.
    answer = json.loads(mint("eval", "ev@1", "ev@2", "--dataset", str(data), "--metric", "logprob",
                             "--server", server.url, "--api-key", KEY_A, "--json"))
    before, after = answer["results"]
    assert (before["revision"], after["revision"]) == ("ev@1", "ev@2") and before["n"] == after["n"] == 1
    assert after["value"] > before["value"] + 1  # training on the target raised its likelihood
    assert answer["dataset"].startswith("trained.jsonl@")
    api = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A})
    recorded = api.get("mint/catalog/revisions/ev@2/evals").json()["items"]
    assert [(e["metric"], e["value"], e["dataset"]) for e in recorded] == [("logprob", after["value"], answer["dataset"])]

    # Over HTTP directly: a future; the score is what the outputs earn.
    r = api.post("mint/evals", json={"revisions": ["ev@1", "ev@2"], "metric": "contains", "dataset": ROWS,
                                     "max_tokens": 8, "include_outputs": True, "record": False})
    assert r.status_code == 200, r.text
    result = api.post("retrieve_future", json={"request_id": r.json()["request_id"]}, timeout=120)
    while result.json().get("type") == "try_again":
        result = api.post("retrieve_future", json={"request_id": r.json()["request_id"]}, timeout=120)
    body = result.json()
    assert body["type"] == "mint_eval" and [x.get("eval_id") for x in body["results"]] == [None, None]
    for x in body["results"]:
        hits = [correct("contains", out, next(row[k] for k in ("target", "answer") if k in row))
                for out, row in zip(x["outputs"], ROWS, strict=True)]
        assert x["value"] == sum(hits) / len(hits)

    # Bad input names the field; another tenant's revisions do not exist for it.
    bad = api.post("mint/evals", json={"revisions": ["ev@1"], "metric": "bleu", "dataset": ROWS})
    assert bad.status_code == 400 and "metric" in bad.json()["detail"]
    bad = api.post("mint/evals", json={"revisions": ["ev@1"], "metric": "regex", "dataset": [{"prompt": "p", "target": "("}]})
    assert bad.status_code == 400 and "dataset[0].target" in bad.json()["detail"]
    bad = api.post("mint/evals", json={"revisions": ["ev@1"], "metric": "contains", "dataset": ROWS, "temperature": 1})
    assert bad.status_code == 400 and "temperature" in bad.json()["detail"]
    other = httpx.post(f"{server.url}/api/v1/mint/evals", headers={"X-API-Key": KEY_B},
                       json={"revisions": ["ev@1"], "metric": "contains", "dataset": ROWS})
    assert other.status_code == 404


def test_eval_cli_runs_its_own_engine_on_the_data_dir(tiny_dir: Path, tmp_path: Path) -> None:
    data_dir, owner = tmp_path / "data", "local-owner"
    common = ["--data-dir", str(data_dir), "--owner", owner]
    mint("catalog", "seed", "--servable", "--base-model", str(tiny_dir), "--policies", "2", "--rank", "2",
         "--prefix", "loc-", *common)
    data = tmp_path / "set.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    first, second = (f"loc-{i:0{DIGITS}d}" for i in range(2))
    table = mint("eval", f"{first}@prod", f"{second}@prod", "--dataset", str(data), "--metric", "exact_match",
                 "--base-model", str(tiny_dir), "--max-tokens", "4", "--show", "2", *common)
    assert f"{first}@1" in table and f"{second}@1" in table and PROMPT in table  # side by side, with the examples
    with Catalog.open(data_dir=data_dir) as catalog:
        for ref in (f"{first}@prod", f"{second}@prod"):
            (record,) = catalog.list_evals(owner, ref, metric="exact_match").items
            assert record.dataset.startswith("set.jsonl@") and 0.0 <= record.value <= 1.0
    # `mint eval list` still reads them.
    listed = json.loads(mint("eval", "list", f"{first}@prod", "--json", *common))
    assert [e["metric"] for e in listed["items"]] == ["exact_match"]
