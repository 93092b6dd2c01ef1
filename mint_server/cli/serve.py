"""`mint serve`: prepare the base model, start the engine, serve the Tinker API over HTTP."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mint_server.api.auth import load_or_create_key_file  # stdlib only: cheap for every `mint` command

if TYPE_CHECKING:  # the engine (torch) is imported only when `serve` runs, not for every CLI call
    from mint_server.engine.local import EngineSettings

log = logging.getLogger("mint_server.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def collect_keys(cli_keys: list[str]) -> tuple[str, ...]:
    env = os.environ.get("MINT_API_KEYS", "")
    keys = [k.strip() for k in [*cli_keys, *env.split(",")] if k.strip()]
    return tuple(dict.fromkeys(keys))  # de-duplicated, order kept


def server_key(path: Path) -> str:
    """The key `mint serve` uses when none is given: created once in the data dir, then reused.
    Only the file's path is ever shown; the key itself is never printed or logged."""
    try:
        key = load_or_create_key_file(path)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"cannot use the API key file: {e}", param_hint="--api-key") from None
    if path.stat().st_mode & 0o077:
        log.warning("%s is readable by other users; chmod 600 it", path)
    typer.echo(f"API key: in {path} (clients send it as X-API-Key; TINKER_API_KEY=$(cat {path}))")
    return key


def base_model_name(arg: str | None, model_dir: Path) -> str:
    """The name clients use for the base model: the default's hub name, or what the dir was prepared from."""
    from mint_server.model.prepare import DEFAULT_BASE_MODEL, MARKER

    if arg is None or arg == DEFAULT_BASE_MODEL:
        return DEFAULT_BASE_MODEL
    try:
        return str(json.loads((model_dir / MARKER).read_text())["source"])
    except (OSError, ValueError, KeyError):
        return model_dir.name


# Engine sizes `mint serve` uses unless told otherwise. They fit the embedded SmolLM2-135M on a
# 24 GiB CPU box. The KV cache is the big fixed cost: layers × kv_slots × kv_heads × max_seq_len ×
# head_dim × 2 (K, V) × 4 bytes (float32), i.e. 30 × 32 × 3 × 2048 × 64 × 8 ≈ 2.8 GiB; the LoRA
# bank (adapter slots × max rank) and the model itself (0.5 GiB) are small beside it. Bigger
# models need smaller values.
DEFAULT_ADAPTER_SLOTS = 16
DEFAULT_MAX_RANK = 32
DEFAULT_KV_SLOTS = 32
DEFAULT_MAX_SEQ_LEN = 2048


def engine_settings(adapter_slots: int, max_rank: int, kv_slots: int, max_seq_len: int) -> EngineSettings:
    """The engine's sizes from the flags; a bad value is a usage error, not a traceback from the engine."""
    from mint_server.engine.local import EngineSettings

    for flag, value in (("--adapter-slots", adapter_slots), ("--max-rank", max_rank), ("--kv-slots", kv_slots)):
        if value < 1:
            raise typer.BadParameter(f"must be at least 1, got {value}", param_hint=flag)
    if max_seq_len < 2:
        raise typer.BadParameter(f"must be at least 2, got {max_seq_len}", param_hint="--max-seq-len")
    return EngineSettings(adapter_slots=adapter_slots, max_rank=max_rank, kv_slots=kv_slots, max_seq_len=max_seq_len)


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        base_model: str = typer.Option(None, "--base-model", help="HF checkpoint dir, or omit for the embedded default."),
        host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
        port: int = typer.Option(8000, help="TCP port."),
        data_dir: Path = typer.Option(None, "--data-dir", help="State dir (default $MINT_HOME or ~/.mint)."),
        db_url: str = typer.Option(
            None, "--db-url", envvar="MINT_DB_URL",
            help="Policy catalog database, e.g. postgresql+psycopg://… (default SQLite in the data dir).",
        ),
        api_key: list[str] = typer.Option(
            [], "--api-key",
            help="Accepted API key (tml-… or sk-…); repeatable. Also read from $MINT_API_KEYS. "
            "Without any, a key is created once and kept in <data dir>/api_key.",
        ),
        no_auth: bool = typer.Option(False, "--no-auth", help="Accept requests without a key (loopback hosts only)."),
        max_body_mb: int = typer.Option(256, help="Largest request body accepted, in MiB."),
        adapter_slots: int = typer.Option(
            DEFAULT_ADAPTER_SLOTS, "--adapter-slots", help="LoRA adapters resident at once (training + sampling)."
        ),
        max_rank: int = typer.Option(DEFAULT_MAX_RANK, "--max-rank", help="Largest LoRA rank a client may ask for."),
        kv_slots: int = typer.Option(
            DEFAULT_KV_SLOTS, "--kv-slots", help="KV cache budget, in sequences of --max-seq-len tokens."
        ),
        max_seq_len: int = typer.Option(
            DEFAULT_MAX_SEQ_LEN, "--max-seq-len",
            help="Longest sequence sampled (prompt + max_tokens); capped at the model's context.",
        ),
        log_level: str = typer.Option("info", help="Log level."),
    ) -> None:
        """Serve LoRA training and sampling behind the Tinker API."""
        import uvicorn

        from mint_server.api.app import create_app
        from mint_server.api.auth import check_key_form
        from mint_server.api.settings import Settings
        from mint_server.engine.local import LocalEngine
        from mint_server.model.config import ModelError
        from mint_server.model.prepare import resolve_base_model
        from mint_server.paths import data_dir as resolve_data_dir

        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        keys = collect_keys(api_key)
        if no_auth and not is_loopback(host):
            raise typer.BadParameter("--no-auth is only allowed when --host is a loopback address", param_hint="--no-auth")
        for i, key in enumerate(keys):
            try:
                check_key_form(key)
            except ValueError as e:  # never echo the key itself
                raise typer.BadParameter(f"API key #{i + 1}: {e}", param_hint="--api-key") from None

        engine_cfg = engine_settings(adapter_slots, max_rank, kv_slots, max_seq_len)
        root = resolve_data_dir(data_dir)
        if not keys and not no_auth:
            keys = (server_key(root / "api_key"),)
        try:
            model_dir = resolve_base_model(base_model, root)
            name = base_model_name(base_model, model_dir)
            typer.echo(f"loading {name} from {model_dir}")
            engine = LocalEngine(model_dir, base_model=name, settings=engine_cfg)
        except ModelError as e:
            raise typer.BadParameter(str(e), param_hint="--base-model") from None
        settings = Settings(
            data_dir=root, api_keys=keys, no_auth=no_auth, db_url=db_url, max_body_bytes=max_body_mb * 1024 * 1024
        )
        try:
            app = create_app(engine, settings)
        except Exception as e:
            # A bad URL or an unreachable database: one line naming the flag, not a traceback.
            if not type(e).__module__.startswith(("sqlalchemy", "mint_server.catalog")):
                raise
            engine.shutdown(False)
            detail = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
            raise typer.BadParameter(f"cannot open the policy catalog: {detail}", param_hint="--db-url") from None
        auth = "no auth" if no_auth else f"{len(keys)} API key(s)"
        typer.echo(f"MinT serving {name} on http://{host}:{port} (data dir {root}; {auth})")
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=settings.drain_timeout_s)
