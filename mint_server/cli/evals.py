"""`mint eval NAME@A NAME@B … --dataset FILE.jsonl --metric exact_match|contains|regex|logprob`: an eval
comparing revisions (api/catalog/evals.py says what each metric measures), printed side by side and stored
as eval records on each revision (`mint eval list REF` shows them; so does the dashboard).

Local mode runs the revisions through an engine of its own on the data dir's catalog (every example
of every revision submitted at once: the engine batches them across adapters). With --server, the
server runs it (`POST /api/v1/mint/evals`, a future polled like any other).

`mint eval run …` is the same command; `mint eval record` and `mint eval list` remain subcommands
(a policy literally named `record` or `list` is evaluated with `mint eval run`).
"""


import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from mint_server.catalog.errors import CatalogError, InvalidArgument
from mint_server.cli.catalog_command import CatalogLocation, command, emit, new_table, out, served_key

# No `from __future__ import annotations`: typer reads the real Annotated types of the options.
POLL_S = 20.0


class EvalGroup(TyperGroup):
    """`mint eval REF …` runs the `run` subcommand; named subcommands keep their names."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _remote(target: CatalogLocation, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    key = target.api_key or served_key(target.data_dir)
    headers = {"X-API-Key": key} if key else {}
    with httpx.Client(base_url=target.server.rstrip("/") + "/api/v1", headers=headers, timeout=POLL_S + 30) as http:
        try:
            r = http.post("mint/evals", json=body)
            if r.status_code >= 400:
                raise CatalogError(r.json().get("detail", r.text))
            request_id = r.json()["request_id"]
            while True:  # the server long-polls: each answer comes when the eval ends or after POLL_S
                r = http.post("retrieve_future", json={"request_id": request_id})
                answer = r.json()
                if r.status_code >= 400 and answer.get("type") != "try_again":
                    raise CatalogError(answer.get("detail", r.text))
                if answer.get("type") == "try_again":
                    time.sleep(0.2 if r.status_code == 408 else 0)
                    continue
                if "error" in answer:
                    raise CatalogError(answer["error"])
                return answer
        except httpx.HTTPError as e:
            raise CatalogError(f"cannot reach MinT server at {target.server}: {e}") from None


def _local(target: CatalogLocation, body: dict[str, Any], base_model: str | None) -> dict[str, Any]:
    from mint_server.api.catalog.evals import Evaluation, dataset_id, examples_from, resolve_targets
    from mint_server.api.tinker.validate import InvalidInput
    from mint_server.catalog.catalog import Catalog
    from mint_server.cli.serve import base_model_name
    from mint_server.engine.local import LocalEngine
    from mint_server.model.prepare import resolve_base_model
    from mint_server.paths import data_dir as resolve_data_dir

    root = resolve_data_dir(target.data_dir)
    owner = target.local_owner()
    catalog = Catalog.open(target.db_url, data_dir=root)
    engine = None
    try:
        examples = examples_from(body["dataset"], body["metric"])
        model_dir = resolve_base_model(base_model, root)
        engine = LocalEngine(model_dir, base_model_name(base_model, model_dir))
        targets = resolve_targets(catalog, owner, body["revisions"], engine.base_model)
        evaluation = Evaluation(engine, engine.tokenizer, body["metric"], examples, max_tokens=body["max_tokens"],
                                chat=body["chat"], key="eval")
        scores = evaluation.run(targets)
        dataset = dataset_id(body["dataset_name"], examples)
        records = catalog.record_evals(owner, [(s.ref, s.value) for s in scores], body["metric"], dataset=dataset) \
            if body["record"] else []
    except InvalidInput as e:
        raise InvalidArgument.from_error(e) from None
    finally:
        if engine is not None:
            engine.shutdown()
        catalog.close()
    return {"metric": body["metric"], "dataset": dataset, "results": [
        {"revision": s.ref, "sha256": s.sha256, "value": s.value, "n": s.n,
         "eval_id": records[i].id if records else None, "outputs": s.outputs}
        for i, s in enumerate(scores)]}


def _render(answer: dict[str, Any], examples: list[dict[str, Any]], show: int) -> None:
    results = answer["results"]
    table = new_table("", *(r["revision"] for r in results))
    table.add_row(answer["metric"], *(f"{r['value']:.4f}" for r in results))
    table.add_row("examples", *(str(r["n"]) for r in results))
    table.add_row("sha256", *(r["sha256"][:12] for r in results))
    out.print(table)
    out.print(f"dataset {answer['dataset']}" + ("" if results[0].get("eval_id") is None else " · recorded"),
              markup=False, highlight=False)
    if show:
        side = new_table("prompt", "target", *(r["revision"] for r in results))
        for i, ex in enumerate(examples[:show]):
            target = next((ex[k] for k in ("target", "answer", "completion") if k in ex), "")
            side.add_row(ex["prompt"], target, *((r.get("outputs") or [""] * (i + 1))[i] for r in results))
        out.print(side)


def register(eval_app: typer.Typer) -> None:
    eval_app.info.cls = EvalGroup

    @eval_app.command("run")
    @command
    def eval_run(
        target: CatalogLocation,
        refs: Annotated[list[str], typer.Argument(help="Revisions to compare: NAME@N, NAME@ALIAS, NAME@<sha>.")],
        dataset: Annotated[Path, typer.Option("--dataset", help="JSON lines: {\"prompt\": …, \"target\": …}.")],
        metric: Annotated[str, typer.Option("--metric", help="exact_match | contains | regex | logprob.")],
        max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Longest completion.")] = 64,
        chat: Annotated[bool, typer.Option("--chat", help="Prompt as a user message via the chat template.")] = False,
        name: Annotated[str | None, typer.Option("--name", help="Dataset label (default: the file's name).")] = None,
        record: Annotated[bool, typer.Option("--record/--no-record", help="Store eval records.")] = True,
        show: Annotated[int, typer.Option("--show", min=0, help="Print the first N examples side by side.")] = 0,
        base_model: Annotated[str | None, typer.Option(
            "--base-model", help="Local mode: HF checkpoint dir (default: the embedded model).")] = None,
    ) -> None:
        """Evaluate revisions side by side on a dataset; store the scores as eval records."""
        from mint_server.api.catalog.evals import check_metric, parse_jsonl
        from mint_server.api.tinker.validate import InvalidInput

        try:
            check_metric(metric)
            rows = parse_jsonl(dataset.read_text())
        except InvalidInput as e:
            raise InvalidArgument.from_error(e) from None
        body = {"revisions": refs, "metric": metric, "dataset": rows, "dataset_name": name or dataset.name,
                "max_tokens": max_tokens, "chat": chat, "record": record, "include_outputs": bool(show)}
        answer = _remote(target, body) if target.server else _local(target, body, base_model)
        if not show:
            for r in answer["results"]:
                r.pop("outputs", None)
        emit(target, answer, lambda: _render(answer, rows, show))

