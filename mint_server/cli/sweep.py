"""`mint sweep`: the single-engine sweep — every selected policy's current revision sampled on a
prompt set through one engine, each result stored as an eval record; and the servable payloads
`mint catalog seed --servable` fills a catalog with (distinct real adapters for a base model).

The sweep is resumable: a revision that already has this sweep's metric is skipped. Outputs go to
`<out>/<first policy>--<last policy>.json` a batch at a time (atomic), then the batch's scores (mean
logprob of the sampled tokens) to the catalog in one transaction.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from mint_server.catalog.catalog import Catalog
    from mint_server.catalog.records import Revision
    from mint_server.engine.values import AdapterSource

log = logging.getLogger(__name__)
TARGETS = ("q_proj", "v_proj")


def servable_payloads(model_dir: Path, rank: int) -> tuple[str, dict[str, Any], Callable[[int], dict[str, bytes]]]:
    """(base model name, LoRA config, index → PEFT payload): deterministic, distinct per index, fp32
    tensors (what the catalog stores for every adapter: peft_io.save_peft writes fp32)."""
    import numpy as np

    from mint_server.cli.serve import base_model_name
    from mint_server.model.config import ModelConfig
    from mint_server.model.lora import target_shapes
    from mint_server.model.peft_io import peft_key

    cfg = ModelConfig.from_hf_dir(model_dir)
    name = base_model_name(str(model_dir), model_dir)
    shapes = target_shapes(cfg)
    config = json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": name, "r": rank,
        "lora_alpha": 2.0 * rank, "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
    }, sort_keys=True).encode()
    lora = {"rank": rank, "train_attn": True, "train_mlp": False, "train_unembed": False}
    # Every payload has the same tensors at the same offsets, so the safetensors header is built once
    # and a payload is that header and one random fp32 buffer (100K adapters: generation stays a
    # small part of seeding).
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in TARGETS:
        layers, fan_in, fan_out = shapes[t]
        for layer in range(layers):
            for which, shape in (("A", [rank, fan_in]), ("B", [fan_out, rank])):
                size = 4 * shape[0] * shape[1]
                header[peft_key(t, layer, which)] = {"dtype": "F32", "shape": shape,
                                                     "data_offsets": [offset, offset + size]}
                offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    prefix = len(head).to_bytes(8, "little") + head

    def payload(index: int) -> dict[str, bytes]:
        # Uniform in [-0.05, 0.05): as servable as a normal draw and a quarter of its cost.
        out = bytearray(len(prefix) + offset)
        out[: len(prefix)] = prefix
        weights = np.frombuffer(out, np.float32, offset // 4, len(prefix))
        np.random.default_rng(index).random(out=weights, dtype=np.float32)
        weights -= 0.5
        weights *= 0.1
        return {"adapter_config.json": config, "adapter_model.safetensors": bytes(out)}

    return name, lora, payload


def revision_source(catalog: Catalog, revision: Revision) -> AdapterSource:
    """The engine's source for a catalog revision, read and verified from the blob store on a loader thread."""
    from mint_server.engine.values import AdapterSource

    return AdapterSource.of_revision(revision.sha256, lambda: catalog.read_payload(revision))


def register(app: typer.Typer) -> None:
    @app.command()
    def sweep(
        prompts: Path = typer.Option(..., "--prompts", help="A text file: one prompt per line."),
        policy_prefix: str = typer.Option(None, "--policy-prefix", help="Only policies whose name starts so."),
        all_policies: bool = typer.Option(False, "--all", help="Every policy of the owner."),
        alias: str = typer.Option("prod", "--alias", help="The alias to sweep (a policy without it: its latest)."),
        max_tokens: int = typer.Option(16, "--max-tokens", min=1),
        name: str = typer.Option("sweep", "--name", help="The eval metric the scores are stored under."),
        out_dir: Path = typer.Option(None, "--out", help="Where outputs are written (default <data dir>/sweeps/NAME)."),
        base_model: str = typer.Option(None, "--base-model", help="HF checkpoint dir (default: the embedded model)."),
        data_dir: Path = typer.Option(None, "--data-dir", help="Data dir (default $MINT_HOME or ~/.mint)."),
        db_url: str = typer.Option(None, "--db-url", envvar="MINT_DB_URL"),
        store: str = typer.Option(None, "--store", envvar="MINT_STORE",
                                  help="Catalog blob store (a path or s3://BUCKET/PREFIX; default <data dir>/blobs)."),
        owner: str = typer.Option(None, "--owner", help="Whose policies (default: the data dir's key owner)."),
        window: int = typer.Option(64, "--window", min=1, help="Policies in flight at once."),
    ) -> None:
        """Sample every selected policy's current revision on a prompt set; store outputs and scores."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if bool(policy_prefix) == all_policies:
            raise typer.BadParameter("give exactly one of --policy-prefix and --all", param_hint="--all")
        try:
            lines = [line for line in prompts.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise typer.BadParameter(str(e), param_hint="--prompts") from None
        if not lines:
            raise typer.BadParameter("no prompts in the file", param_hint="--prompts")
        from mint_server.api.auth.keys import data_dir_owner
        from mint_server.catalog.catalog import Catalog
        from mint_server.cli.serve import base_model_name
        from mint_server.engine.local import LocalEngine
        from mint_server.model.prepare import resolve_base_model
        from mint_server.paths import data_dir as resolve_data_dir

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        root = resolve_data_dir(data_dir)
        who = owner or data_dir_owner(root)
        model_dir = resolve_base_model(base_model, root)
        engine = LocalEngine(model_dir, base_model_name(base_model, model_dir))
        catalog = Catalog.open(db_url, data_dir=root, store=store)
        out = out_dir or root / "sweeps" / name
        columns = (TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        try:
            with Progress(*columns, transient=True) as progress:
                task = progress.add_task("sweep", total=None)
                done = run_sweep(engine, catalog, who, lines, policy_prefix or "", alias, max_tokens, name, out,
                                 window, lambda n: progress.update(task, completed=n))
        finally:
            engine.shutdown()
            catalog.close()
        typer.echo(json.dumps(done))


def run_sweep(engine: Any, catalog: Any, owner: str, prompts: list[str], prefix: str, alias: str,
              max_tokens: int, metric: str, out: Path, window: int,
              progress: Callable[[int], None] = lambda n: None, batch: int = 100) -> dict[str, int]:
    """The sweep loop (see the module doc); returns counts of swept, skipped and failed policies."""
    from tinker import types

    from mint_server.catalog.errors import NotFound
    from mint_server.engine.values import Priority
    from mint_server.fsutil import atomic_write_json

    tok = engine.tokenizer
    encoded = [tok(p)["input_ids"] for p in prompts]
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    counts = {"swept": 0, "skipped": 0, "failed": 0}
    inflight: deque[tuple[Any, Any, list[Any]]] = deque()
    finished: list[dict[str, Any]] = []  # written (outputs file, then evals) a batch at a time

    def flush() -> None:
        if not finished:
            return
        # Outputs first, then the evals in one transaction: a crash in between re-sweeps the batch.
        atomic_write_json(out / f"{finished[0]['policy']}--{finished[-1]['policy']}.json", finished)
        catalog.record_evals(owner, [(r["revision"], r["score"]) for r in finished], metric,
                             dataset=f"prompts:{len(prompts)}")
        counts["swept"] += len(finished)
        finished.clear()

    def finish() -> None:
        policy, revision, futures = inflight.popleft()
        try:
            results = [f.result() for f in futures]
        except Exception as e:  # noqa: BLE001 - one bad revision does not stop the sweep
            log.warning("sweep: %s failed: %s", revision.ref, e)
            counts["failed"] += 1
            return
        seqs = [r.sequences[0] for r in results]
        lps = [lp for s in seqs for lp in (s.logprobs or [])]
        finished.append({
            "policy": policy.name, "revision": revision.ref, "sha256": revision.sha256,
            "score": sum(lps) / len(lps) if lps else 0.0,
            "outputs": [tok.decode(s.tokens, skip_special_tokens=True) for s in seqs],
        })
        if len(finished) >= batch:
            flush()

    cursor = None
    seen = 0
    while True:
        page = catalog.list_policies(owner, cursor=cursor, limit=500)
        for policy in page.items:
            if not policy.name.startswith(prefix):
                continue
            seen += 1
            try:
                revision = catalog.resolve(owner, f"{policy.name}@{alias}")
            except NotFound:
                revision = catalog.resolve(owner, policy.name)
            if catalog.list_evals(owner, revision.ref, metric=metric, limit=1).items:
                counts["skipped"] += 1  # resumed: swept before
                continue
            source = revision_source(catalog, revision)
            # a sweep is batch work: serving and rollouts on the same engine go first (as evals do)
            futures = [engine.submit(engine.prepare_sample(source, ids, 1, params, key="sweep", priority=Priority.BATCH))
                       for ids in encoded]
            inflight.append((policy, revision, futures))
            if len(inflight) >= window:
                finish()
            progress(seen)
        if (cursor := page.next_cursor) is None:
            break
    while inflight:
        finish()
    flush()
    progress(seen)
    return counts
