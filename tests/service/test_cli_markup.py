"""Stored names and metrics print as they are in the CLI's tables (issue 52, item 4): a key or an
eval metric named with console markup (`[/]`) must not crash `mint key list` / `mint eval list`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.catalog.helpers import BASE_MODEL, write_peft
from tests.catalog.test_cli import run

MARKUP = ["[/]", "[bold red]loud[/]", "[link=x]"]


def test_markup_in_stored_names_lists_verbatim(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "home")]
    run("policy", "create", "chat", "--base-model", BASE_MODEL, "--rank", "2", *data)
    run("import", str(write_peft(tmp_path / "p1", 1)), "--policy", "chat", *data)
    for name in MARKUP:
        run("key", "create", name, "--scope", "serve", "--owner", "ann", *data, "--json")
        run("eval", "record", "chat@1", name, "0.5", "--dataset", name, *data, "--json")

    keys = run("key", "list", "--owner", "ann", *data).stdout
    evals = run("eval", "list", "chat@1", *data).stdout
    for name in MARKUP:
        assert name in keys, keys
        assert name in evals, evals
    assert {k["name"] for k in json.loads(run("key", "list", "--owner", "ann", *data, "--json").stdout)} \
        == set(MARKUP)
