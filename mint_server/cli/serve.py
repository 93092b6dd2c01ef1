"""`mint serve`: prepare the base model, start the engine, serve the Tinker API over HTTP."""

from __future__ import annotations

import faulthandler
import inspect
import ipaddress
import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core
from rich.markup import escape as rich_escape

from mint_server.api.auth.keys import load_or_create_key_file  # stdlib only: cheap for every `mint` command

if TYPE_CHECKING:  # the engine (torch) is imported only when `serve` runs; its settings module is light
    from mint_server.engine.settings import EngineSettings

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


def engine_settings(store_dir: Path, compile_cache_dir: Path | None = None, **flags: Any) -> EngineSettings:
    """The engine's settings from the engine flags, by EngineSettings field name (unset flags, None,
    keep EngineSettings' defaults; a deprecated spelling counts where its setting's own flag is unset);
    a bad value is a usage error naming the flag, not a traceback from the engine."""
    from mint_server.engine.settings import EngineSettings, InvalidSetting, setting_infos

    infos = {info.name: info for info in setting_infos()}
    for info in infos.values():
        for old in info.deprecated_flags:
            value = flags.pop(_param_name(old), None)
            if value is not None:
                log.warning("%s is deprecated; use %s", old, info.flag)
                flags[info.name] = value if flags.get(info.name) is None else flags[info.name]
    if unknown := set(flags) - {name for name, info in infos.items() if info.flag is not None}:
        raise TypeError(f"not engine flags: {', '.join(sorted(unknown))}")
    given = {name: value for name, value in flags.items() if value is not None}
    settings = EngineSettings(store_dir=store_dir, compile_cache_dir=compile_cache_dir, **given)
    try:
        settings.check()
    except InvalidSetting as e:
        flag = infos[e.field].flag if e.field in infos else None
        raise typer.BadParameter(str(e), param_hint=flag or "--" + e.field.replace("_", "-")) from None
    return settings


def _param_name(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


ENGINE_PANEL = "Engine settings"


def engine_options() -> list[inspect.Parameter]:
    """`mint serve`'s engine options, generated from EngineSettings: one per field that has a flag
    (its help, type and default from the field), then its deprecated spellings. Unset, each is None,
    so EngineSettings' own default (environment included) holds."""
    from mint_server.engine.settings import setting_infos

    def option(name: str, kind: type, *decls: str, help: str) -> inspect.Parameter:
        info = typer.Option(*decls, help=help, show_default=False, rich_help_panel=ENGINE_PANEL)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=Annotated[kind | None, info])

    params = []
    for info in setting_infos():
        if info.flag is None:
            continue
        # The default is part of the help, not typer's show_default: the option's own default is None
        # (unset), and typer would write a default given as text in parentheses. Escaped where typer
        # renders help with rich (TYPER_USE_RICH unset or true), which reads "[default: …]" as a style tag.
        default = f"[default: {info.default_text}]"
        help = f"{info.help} {rich_escape(default) if getattr(typer.core, 'HAS_RICH', True) else default}"
        params.append(option(info.name, info.type, *info.flag_decls, help=help))
        params += [option(_param_name(old), info.type, old, help=f"Deprecated alias of {info.flag}.")
                   for old in info.deprecated_flags]
    return params


def with_engine_options(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn(..., **engine_flags)` with the engine options in its signature (typer reads __signature__)."""
    own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    fn.__signature__ = inspect.Signature([*own, *engine_options()])  # type: ignore[attr-defined]
    return fn


def fleet_engine(model_dir: Path, name: str, settings: EngineSettings, ray: str, replicas: int) -> object:
    from mint_server.engine.interface import NotSupportedError
    from mint_server.engine.settings import FleetSettings

    fleet = FleetSettings(replicas=replicas, ray_address=None if ray == "local" else ray)
    try:
        fleet.check()
        from mint_server.engine.fleet import FleetEngine, ray_module

        ray_module()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--replicas") from None
    except NotSupportedError as e:
        raise typer.BadParameter(str(e), param_hint="--ray") from None
    typer.echo(f"starting {replicas} engine replicas on Ray ({ray})")
    return FleetEngine(model_dir, name, settings=settings, fleet=fleet)


def register(app: typer.Typer) -> None:
    @app.command()
    @with_engine_options
    def serve(
        base_model: str = typer.Option(None, "--base-model", help="HF checkpoint dir, or omit for the embedded default."),
        host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
        port: int = typer.Option(8000, help="TCP port."),
        data_dir: Path = typer.Option(None, "--data-dir", help="State dir (default $MINT_HOME or ~/.mint)."),
        db_url: str = typer.Option(
            None, "--db-url", envvar="MINT_DB_URL",
            help="Policy catalog database, e.g. postgresql+psycopg://… (default SQLite in the data dir).",
        ),
        store: str = typer.Option(
            None, "--store", envvar="MINT_STORE",
            help="Catalog blob store: a path, or s3://BUCKET/PREFIX shared by several nodes (endpoint and "
            "credentials from the AWS_* env vars). Default <data dir>/blobs.",
        ),
        api_key: list[str] = typer.Option(
            [], "--api-key",
            help="Accepted API key (tml-… or sk-…); repeatable. Also read from $MINT_API_KEYS. "
            "Without any, a key is created once and kept in <data dir>/api_key.",
        ),
        no_auth: bool = typer.Option(False, "--no-auth", help="Accept requests without a key (loopback hosts only)."),
        max_body_mb: int = typer.Option(256, help="Largest request body accepted, in MiB."),
        ray: str = typer.Option(
            None, "--ray",
            help="Serve from a fleet of engine replicas on Ray: 'local' starts a Ray instance here; 'auto' or "
            "HOST:PORT joins a cluster (`ray start --head` / `ray start --address`). Needs Ray (the package's fleet extra); "
            "see docs/fleet.md.",
        ),
        replicas: int = typer.Option(2, "--replicas", help="Engine replicas with --ray (each its own adapter tiers)."),
        log_level: str = typer.Option("info", help="Log level."),
        **engine_flags: Any,
    ) -> None:
        """Serve LoRA training and sampling behind the Tinker API."""

        from mint_server.api.auth.keys import check_key_form
        from mint_server.api.http.app import create_app
        from mint_server.api.http.server import ConnectionLimits, Server, uvicorn_config
        from mint_server.api.settings import Settings
        from mint_server.engine.interface import NotSupportedError
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

        root = resolve_data_dir(data_dir)
        engine_cfg = engine_settings(root / "pages", root / "compile-cache", **engine_flags)
        if not keys and not no_auth:
            keys = (server_key(root / "api_key"),)
        try:
            model_dir = resolve_base_model(base_model, root)
            name = base_model_name(base_model, model_dir)
            typer.echo(f"loading {name} from {model_dir}")
            if ray is None:
                engine = LocalEngine(model_dir, base_model=name, settings=engine_cfg)
            else:
                engine = fleet_engine(model_dir, name, engine_cfg, ray, replicas)
        except ModelError as e:
            raise typer.BadParameter(str(e), param_hint="--base-model") from None
        except NotSupportedError as e:  # e.g. a model whose heads do not split over --tp ranks
            hint = "--quantize" if str(e).startswith("--quantize") else "--tp"  # a family it cannot quantize
            raise typer.BadParameter(str(e), param_hint=hint) from None
        settings = Settings(
            data_dir=root, api_keys=keys, no_auth=no_auth, db_url=db_url, store_url=store, max_body_bytes=max_body_mb * 1024 * 1024,
        )
        try:
            app = create_app(engine, settings)
        except Exception as e:
            # A bad URL or an unreachable database: one line naming the flag, not a traceback.
            if not type(e).__module__.startswith(("sqlalchemy", "mint_server.catalog")):
                raise
            engine.shutdown(False)
            detail = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
            hint = "--store" if getattr(e, "field", None) == "store" else "--db-url"
            raise typer.BadParameter(f"cannot open the policy catalog: {detail}", param_hint=hint) from None
        auth = "no auth" if no_auth else f"{len(keys)} API key(s)"
        typer.echo(f"MinT serving {name} on http://{host}:{port} (data dir {root}; {auth})")
        # Bounded request heads (431), slow heads and bodies timed out (408): see api/http/server.py.
        config = uvicorn_config(
            app, ConnectionLimits(), host=host, port=port, log_level=log_level,
            timeout_graceful_shutdown=settings.drain_timeout_s,
        )
        # `kill -USR1 <pid>` prints every thread's stack to the log: what a server that does not
        # stop (or does not answer) is doing, without a debugger on the box.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        Server(config, app.state.service.begin_shutdown).run()
