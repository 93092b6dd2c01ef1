"""`mint serve`: prepare the base model, start the engine, serve the Tinker API over HTTP."""

from __future__ import annotations

import faulthandler
import ipaddress
import json
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mint_server.api.auth.keys import load_or_create_key_file  # stdlib only: cheap for every `mint` command

if TYPE_CHECKING:  # the engine (torch) is imported only when `serve` runs, not for every CLI call
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


def engine_settings(
    device_slots: int | None, adapter_slots: int | None, host_cache_mb: float | None, max_rank: int | None,
    kv_budget_tokens: int | None, max_context: int | None, max_step_tokens: int | None, store_dir: Path,
    kv_budget_mb: float | None = None,
    threads: int | None = None,
    max_fused_tokens: int | None = None,
    tp: int | None = None,
    checkpoint_from_tokens: int | None = None,
    logits_chunk_mb: float | None = None,
    batch_invariant: bool | None = None,
    max_slowdown: float | None = None,
    step_overhead_tokens: int | None = None,
    linger_s: float | None = None,
    train_slice_tokens: int | None = None,
    sample_steps_per_slice: int | None = None,
    max_chunk_tokens: int | None = None,
    keep_freed_memory: bool | None = None,
    compile: str | None = None,
    compile_cache_dir: Path | None = None,
    prefix_cache: bool | None = None,
    quantize: str | None = None,
) -> EngineSettings:
    """The engine's settings from the flags (unset flags keep EngineSettings' defaults); a bad value is
    a usage error naming the flag, not a traceback from the engine."""
    from mint_server.engine.settings import EngineSettings

    if adapter_slots is not None:
        log.warning("--adapter-slots is deprecated; use --device-slots")
        device_slots = device_slots if device_slots is not None else adapter_slots
    given = {"device_slots": device_slots, "host_cache_mb": host_cache_mb, "max_rank": max_rank,
             "kv_budget_tokens": kv_budget_tokens, "max_context": max_context, "max_step_tokens": max_step_tokens, "kv_budget_mb": kv_budget_mb,
             "threads": threads, "max_fused_tokens": max_fused_tokens, "tp": tp,
             "checkpoint_from_tokens": checkpoint_from_tokens, "logits_chunk_mb": logits_chunk_mb,
             "batch_invariant": batch_invariant, "max_slowdown": max_slowdown, "linger_s": linger_s,
             "step_overhead_tokens": step_overhead_tokens, "train_slice_tokens": train_slice_tokens,
             "sample_steps_per_slice": sample_steps_per_slice, "max_chunk_tokens": max_chunk_tokens,
             "keep_freed_memory": keep_freed_memory, "compile": compile, "compile_cache_dir": compile_cache_dir,
             "prefix_cache": prefix_cache, "quantize": quantize}
    settings = EngineSettings(store_dir=store_dir, **{k: v for k, v in given.items() if v is not None})
    try:
        settings.check()
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise typer.BadParameter(str(e), param_hint="--" + field.replace("_", "-")) from None
    return settings


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


def _default(name: str) -> object:
    """A setting's default as a fresh EngineSettings has it (also those read from the environment)."""
    from mint_server.engine.settings import EngineSettings

    return getattr(EngineSettings(), name)


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
        device_slots: int = typer.Option(
            None, "--device-slots",
            help=f"LoRA adapters in device slots at once (training + sampling) [default: {_default('device_slots')}]; "
            "more adapters wait in the host cache and the store and are paged in as needed.",
        ),
        adapter_slots: int = typer.Option(None, "--adapter-slots", help="Deprecated alias of --device-slots."),
        host_cache_mb: float = typer.Option(
            None, "--host-cache-mb",
            help=f"Host memory for adapters not in a slot (weights, optimizer state) [default: "
            f"{_default('host_cache_mb')}]; beyond it they are paged to the store.",
        ),
        max_rank: int = typer.Option(
            None, "--max-rank", help=f"Largest LoRA rank a client may ask for [default: {_default('max_rank')}]."
        ),
        kv_budget_tokens: int = typer.Option(
            None, "--kv-budget-tokens",
            help=f"KV cache size in token positions shared by running sequences [default: {_default('kv_budget_tokens')}].",
        ),
        kv_budget_mb: float = typer.Option(
            None, "--kv-budget-mb",
            help="KV cache size in MiB instead of positions: the pool holds as many positions as the model's "
            "cache entries fit (MLA's latent cache: several times more than full K/V).",
        ),
        max_seq_len: int = typer.Option(
            None, "--max-seq-len", help="Longest sequence (training datum; prompt + max_tokens) [default: the model's context].",
        ),
        max_step_tokens: int = typer.Option(
            None, "--max-step-tokens",
            help="Decode rows one engine step may run [default: the fewest that reach 90% of the measured best "
            "throughput]; new work waits at most one step.",
        ),
        max_chunk_tokens: int = typer.Option(
            None, "--max-chunk-tokens",
            help="Tokens a step with prompt chunks in it may run, at least --max-step-tokens [default: measured, "
            "the fewest that reach 90% of the best prompt throughput]; a longer prompt is prefilled in chunks "
            "over several steps, beside running streams.",
        ),
        max_slowdown: float = typer.Option(
            None, "--max-slowdown",
            help=f"While a lighter key (or a higher priority class) has work in a step, the step costs at most this "
            f"many times that work alone [default: {_default('max_slowdown')}]; see docs/engine.md (scheduler).",
        ),
        linger_s: float = typer.Option(
            None, "--linger-s",
            help=f"Seconds a lighter key stays protected by --max-slowdown after its work ends, so its next "
            f"request does not arrive to a full step [default: {_default('linger_s')}].",
        ),
        step_overhead_tokens: int = typer.Option(
            None, "--step-overhead-tokens",
            help="A step's fixed cost in token-equivalents, for the scheduler's cost model [default: measured at "
            "start-up].",
        ),
        train_slice_tokens: int = typer.Option(
            None, "--train-slice-tokens",
            help=f"While sampling work waits, a training pass runs in micro-batches of at most this many padded "
            f"tokens with sampler steps between them [default: {_default('train_slice_tokens')}].",
        ),
        sample_steps_per_slice: int = typer.Option(
            None, "--sample-steps-per-slice",
            help=f"Sampler steps between two training slices [default: {_default('sample_steps_per_slice')}].",
        ),
        max_fused_tokens: int = typer.Option(
            None, "--max-fused-tokens",
            help=f"Padded tokens in one fused training pass [default: {_default('max_fused_tokens')}]; more are split "
            "into micro-batches. The peak training memory follows it: set it to one run's batch for no more peak "
            "memory than one run alone.",
        ),
        checkpoint_from_tokens: int = typer.Option(
            None, "--checkpoint-from-tokens",
            help=f"Block activations a training pass keeps for backward, in padded tokens "
            f"[default: {_default('checkpoint_from_tokens')}; 0: no bound]: a pass of T > B tokens recomputes "
            "its first ceil((1 - B/T) x layers) blocks in backward, so activation memory stops growing with the "
            "batch, for that share of one more forward.",
        ),
        logits_chunk_mb: float = typer.Option(
            None, "--logits-chunk-mb",
            help=f"Most fp32 logits one training pass holds at once, MiB [default: {_default('logits_chunk_mb')}]; "
            "bigger logits run in chunks recomputed in backward.",
        ),
        ray: str = typer.Option(
            None, "--ray",
            help="Serve from a fleet of engine replicas on Ray: 'local' starts a Ray instance here; 'auto' or "
            "HOST:PORT joins a cluster (`ray start --head` / `ray start --address`). Needs Ray (the package's fleet extra); "
            "see docs/fleet.md.",
        ),
        replicas: int = typer.Option(2, "--replicas", help="Engine replicas with --ray (each its own adapter tiers)."),
        threads: int = typer.Option(
            None, "--threads",
            help="Intra-op threads of the engine's tensor math [default: the cores this process may run on].",
        ),
        tp: int = typer.Option(
            None, "--tp",
            help=f"Tensor-parallel ranks of the engine's model [default: {_default('tp')}]: this process is rank 0 "
            "and schedules, tp-1 spawned processes run their share (gloo on CPU, NCCL on CUDA: one GPU per "
            "rank). See docs/scale-up.md.",
        ),
        batch_invariant: bool = typer.Option(
            None, "--batch-invariant/--no-batch-invariant",
            help=f"Bitwise batch-invariant numerics [default: {_default('batch_invariant')}]: a row's logits, "
            "logprobs, tokens and gradients never depend on its batch, and sampled logprobs equal the training "
            "forward's (true on-policy RL). Dense families, one rank; slower. See docs/numerics.md.",
        ),
        keep_freed_memory: bool = typer.Option(
            None, "--keep-freed-memory/--no-keep-freed-memory",
            help="CPU: keep freed host memory for the next step instead of returning it to the kernel "
            f"[default: {_default('keep_freed_memory')}]: no page faults on every training step's big blocks "
            "(~5% of an 8 x 256 SmolLM2 step), while the RSS stays at its peak. See docs/training-speed.md.",
        ),
        compile: str = typer.Option(
            None, "--compile",
            help=f"auto or off [default: {_default('compile')} (MINT_COMPILE)]: decode steps as compiled graphs, "
            "compiled in the background after start-up (steps run eagerly meanwhile), cached in the data dir's "
            "compile-cache; off: always eager. See docs/engine.md.",
        ),
        prefix_cache: bool = typer.Option(
            None, "--prefix-cache/--no-prefix-cache",
            help=f"Keep full KV blocks of earlier requests for later ones with the same prefix [default: "
            f"{_default('prefix_cache')}]: a chat's next turn prefills only what is new. Per owner, adapter "
            "revision and base; evicted least recently used. See docs/engine.md.",
        ),
        quantize: str = typer.Option(
            None, "--quantize",
            help=f"none, int8 or int4 [default: {_default('quantize')}]: quantize the frozen base's linear "
            "weights at load (weight-only; int8 per channel, int4 in groups); LoRA adapters train and serve on "
            "top in full precision (QLoRA). Less memory and, on CPU, faster decode. See docs/quantization.md.",
        ),
        log_level: str = typer.Option("info", help="Log level."),
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
        engine_cfg = engine_settings(device_slots, adapter_slots, host_cache_mb, max_rank, kv_budget_tokens,
                                     max_seq_len, max_step_tokens, root / "pages", kv_budget_mb, threads,
                                     max_fused_tokens, tp, checkpoint_from_tokens, logits_chunk_mb,
                                     batch_invariant, max_slowdown=max_slowdown, linger_s=linger_s,
                                     step_overhead_tokens=step_overhead_tokens, train_slice_tokens=train_slice_tokens,
                                     sample_steps_per_slice=sample_steps_per_slice, max_chunk_tokens=max_chunk_tokens,
                                     keep_freed_memory=keep_freed_memory, compile=compile,
                                     compile_cache_dir=root / "compile-cache", prefix_cache=prefix_cache,
                                     quantize=quantize)
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
