"""Scale Out at the seed's scale (a script, not a test): bulk seeding, bytes per policy, and the hooks
the engine side fills (sweep cost per adapter, cold vs hot first token, fleet wave ratio).

    .venv/bin/python -m benchmarks.scale_out                                    # CI size: 1K servable, 10K records
    nice -n 19 .venv/bin/python -m benchmarks.scale_out --servable 100000 --records 1000000 --workdir /big/dir
    … --db-url postgresql+psycopg://…        # the catalog on PostgreSQL (a fresh schema per run)
    … --store s3://bucket/prefix             # blobs on S3 (AWS_* env vars); default <workdir>/…/blobs
    … --compare-s3-clients                   # obstore vs s3fs throughput against a local moto server
    … --workdir DIR --keep, then … --workdir DIR --reuse --hooks ttft_cold_hot   # rerun hooks, no seeding
    … --sweep-sizes 100,1000,10000           # sweep_cost's sizes (powers of ten up to --servable)

Prints, in order:
  1. the disk under --workdir: sequential write (fsync'd) and O_DIRECT read MB/s, and small fsync'd
     files per second (what one-fsync-per-blob seeding was bound by);
  2. seeding: servable SmolLM2 adapters/s (rank 1 on q,v, fp32: what the catalog stores) through the
     bulk path, beside the same adapters written one fsync'd blob each (the old path, on a sample);
     catalog records/s (each policy is 4 rows: policy, revision, alias, alias event);
  3. bytes: catalog bytes per policy record, catalog + blob bytes per adapter revision, host-cache
     bytes per resident adapter (the fp32 weights the residency host tier keeps) and pack-index bytes
     per blob (the in-memory map every reading process keeps);
  4. the engine-side hooks (`--hooks`, default all): sweep_cost (adapters/s, CPU per adapter and its
     ratio largest/smallest sweep, payload vs disk read rate, engine busy fraction), ttft_cold_hot
     (cold vs hot first token p50/p99, idle and under a sweep, and a cold load's stages);
     fleet_wave_ratio (2 Ray replicas vs 1 on a wave of --wave cold catalog policies, a core each);
and last one JSON line with everything. The load average is printed with the figures: the machine
is shared, so rates are floors of what the code does on an idle one.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import load_average, smollm2_dir

OWNER = "bench"
MiB = 1 << 20


# -- 1. the disk ---------------------------------------------------------------------------------
def disk_rates(workdir: Path, size_mb: int = 256, small_files: int = 200) -> dict[str, Any]:
    """Sequential write (4 MiB writes, one fsync at the end) and read (O_DIRECT, so the page cache
    does not answer) of a `size_mb` file, and fsync'd 4 KiB files per second."""
    path = workdir / f"disk-probe-{uuid.uuid4().hex[:8]}"
    chunk = os.urandom(4 * MiB)
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(size_mb // 4):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        write = size_mb * MiB / (time.perf_counter() - t0)
        direct = True
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # e.g. tmpfs: no O_DIRECT; then the page cache may answer
            fd, direct = os.open(path, os.O_RDONLY), False
        buffer = mmap.mmap(-1, 4 * MiB)  # page-aligned, as O_DIRECT needs
        t0 = time.perf_counter()
        total = 0
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
        read = total / (time.perf_counter() - t0)
        small = workdir / f"fsync-probe-{uuid.uuid4().hex[:8]}"
        small.mkdir()
        block = os.urandom(4096)
        t0 = time.perf_counter()
        for i in range(small_files):
            with open(small / str(i), "wb") as f:
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
            dir_fd = os.open(small, os.O_RDONLY)
            os.fsync(dir_fd)
            os.close(dir_fd)
        fsyncs = small_files / (time.perf_counter() - t0)
        shutil.rmtree(small)
    finally:
        path.unlink(missing_ok=True)
    return {"write_MBps": write / 1e6, "read_MBps": read / 1e6, "read_direct": direct,
            "fsynced_small_files_per_s": fsyncs}


# -- 2. seeding ----------------------------------------------------------------------------------
class PauseMeter:
    """Seconds this process did not run: a thread wakes every 0.1 s and counts any gap past 1 s (the
    process was stopped — this shared box SIGSTOPs niced jobs while benchmarks run — or starved).
    Rates are also given over the wall time less these pauses, and as CPU time per item."""

    def __init__(self) -> None:
        self.paused = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.1):
            now = time.monotonic()
            if now - last > 1.0:
                self.paused += now - last - 0.1
            last = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def measured() -> Iterator[dict[str, float]]:
    """Wall, CPU and paused seconds of the block."""
    out: dict[str, float] = {}
    meter = PauseMeter()
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield out
    finally:
        meter.close()
        out.update(seconds=time.perf_counter() - wall, cpu_seconds=time.process_time() - cpu,
                   paused_seconds=meter.paused)

def reporter(label: str, total: int) -> Callable[[int], None]:
    """Progress on stderr with rate and ETA (what `mint catalog seed` shows as a bar)."""
    started = time.perf_counter()

    def report(done: int) -> None:
        elapsed = time.perf_counter() - started
        rate = done / elapsed if elapsed else 0.0
        eta = (total - done) / rate if rate else float("inf")
        print(f"  {label}: {done:,}/{total:,}  {rate:,.0f}/s  ETA {eta:,.0f}s  (load {load_average()})",
              file=sys.stderr, flush=True)

    return report


@contextmanager
def catalog_at(data_dir: Path, db_url: str | None, store: str | None) -> Iterator[Any]:
    """The catalog in `data_dir` (SQLite: fresh, or a reused workdir's), or a fresh schema of the
    PostgreSQL database at db_url."""
    from mint_server.catalog import Catalog

    if db_url is None:
        with Catalog.open(data_dir=data_dir, store=store) as catalog:
            yield catalog
        return
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        url = make_url(db_url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False)
        with Catalog.open(url, data_dir=data_dir, store=store) as catalog:
            yield catalog
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def catalog_bytes(catalog: Any) -> int:
    """What the catalog's database takes on disk (SQLite: the file after a WAL checkpoint; PostgreSQL:
    its tables and indexes)."""
    from sqlalchemy import text

    with catalog.engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            path = Path(catalog.engine.url.database)
            return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
        names = conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
                                  "AND tablename LIKE 'catalog_%'")).scalars().all()
        return sum(conn.execute(text("SELECT pg_total_relation_size(:t)"), {"t": t}).scalar() for t in names)


def store_bytes(catalog: Any) -> int:
    return sum(b.size for b in catalog.blobs.iter())


def seed_servable(catalog: Any, n: int, model_dir: Path, batch: int) -> dict[str, Any]:
    from mint_server.catalog import seed as seeding
    from mint_server.cli.sweep import servable_payloads

    name, lora, payload_for = servable_payloads(model_dir, 1)
    before = catalog_bytes(catalog)
    with measured() as m:
        seeding.seed(catalog, n, owner=OWNER, prefix="sv-", batch_size=batch, payload_for=payload_for,
                     base_model=name, lora_config=lora, progress=reporter("servable", n))
    blobs = store_bytes(catalog)
    active = max(1e-9, m["seconds"] - m["paused_seconds"])
    return {"adapters": n, **m, "adapters_per_s": n / m["seconds"], "adapters_per_active_s": n / active,
            "cpu_ms_per_adapter": 1e3 * m["cpu_seconds"] / max(1, n), "blob_MBps": blobs / m["seconds"] / 1e6,
            "blob_bytes": blobs, "catalog_bytes": catalog_bytes(catalog) - before, "base_model": name,
            "load_average": load_average()}


def one_fsync_per_blob(workdir: Path, n: int, model_dir: Path) -> dict[str, Any]:
    """The old path on a sample: each adapter's blobs written loose, one fsync'd file each (no catalog rows)."""
    from mint_server.catalog.local_blobs import LocalBlobStore
    from mint_server.cli.sweep import servable_payloads

    _, _, payload_for = servable_payloads(model_dir, 1)
    store = LocalBlobStore(workdir / "loose-blobs")
    started = time.perf_counter()
    for i in range(10**6, 10**6 + n):  # indices no seed uses: all new content
        for data in payload_for(i).values():
            store.put_bytes(data)
    seconds = time.perf_counter() - started
    shutil.rmtree(workdir / "loose-blobs")
    return {"adapters": n, "adapters_per_s": n / seconds}


def seed_records(catalog: Any, n: int, batch: int) -> dict[str, Any]:
    from mint_server.catalog import seed as seeding

    before = catalog_bytes(catalog)
    with measured() as m:
        seeding.seed(catalog, n, 1, OWNER, prefix="rec-", batch_size=batch, progress=reporter("records", n))
    rows = 4 * n
    active = max(1e-9, m["seconds"] - m["paused_seconds"])
    return {"policies": n, "rows": rows, **m, "policies_per_s": n / m["seconds"], "rows_per_s": rows / m["seconds"],
            "policies_per_active_s": n / active, "cpu_us_per_policy": 1e6 * m["cpu_seconds"] / max(1, n),
            "catalog_bytes": catalog_bytes(catalog) - before, "load_average": load_average()}


# -- 3. bytes per policy -------------------------------------------------------------------------
def host_bytes_per_adapter(catalog: Any, model_dir: Path) -> dict[str, Any]:
    """Decode one seeded revision as the engine's residency does (load_peft_files): the host tier
    keeps these tensors as fp32 (residency.Adapter.host), so their bytes are what one resident
    adapter costs in host memory."""
    from mint_server.model.config import ModelConfig
    from mint_server.model.peft_io import load_peft_files

    revision = catalog.resolve(OWNER, "sv-000000000@prod")
    weights = load_peft_files(catalog.read_payload(revision), ModelConfig.from_hf_dir(model_dir))
    host = sum(x.numel() * 4 + y.numel() * 4 for x, y in weights.weights.values())
    return {"host_cache_bytes_per_adapter": host, "blob_bytes_per_adapter": revision.size}


# -- 4. the engine-side hooks --------------------------------------------------------------------
@dataclass
class ScaleOutContext:
    """What the hooks get: the seeded catalogs (open) and where everything is."""

    model_dir: Path
    workdir: Path
    servable: Any  # the Catalog holding `servable_count` servable policies sv-000000000…
    records: Any  # the Catalog holding `records_count` record-only policies rec-000000000…
    servable_count: int
    records_count: int
    owner: str = OWNER
    extra: dict[str, Any] = field(default_factory=dict)
    _engine: Any = None

    def engine(self) -> Any:
        """The hooks' one LocalEngine, with the default settings (but `--threads`) and named as the seeded policies' base
        model (what `mint serve` and `mint sweep` start), opened on first use: its start-up measures
        the machine, minutes on a busy one. A hook starts cold by `forget_source(REVISION_KEY_PREFIX)` (every
        catalog adapter out of every tier)."""
        if self._engine is None:
            from mint_server.cli.serve import base_model_name
            from mint_server.engine.local import LocalEngine
            from mint_server.engine.settings import EngineSettings

            self._engine = LocalEngine(self.model_dir, base_model_name(str(self.model_dir), self.model_dir),
                                       settings=EngineSettings(threads=self.extra.get("threads")))
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


PROMPT = "The capital of France is"  # one short prompt: a first token is its prefill and one sampled token
SWEEP_WINDOW = 64  # policies in flight, `mint sweep`'s default


def policy_name(index: int) -> str:
    return f"sv-{index:09d}"


def block_prefix(start: int, count: int) -> str:
    """The name prefix (`mint sweep --policy-prefix`) that selects servable policies start … start+count-1:
    count a power of ten, start a multiple of it."""
    digits = len(str(count)) - 1
    if count != 10**digits or start % count:
        raise ValueError(f"policies {start}+{count}: not a block one name prefix selects (count a power of ten)")
    name = policy_name(start)
    return name[: len(name) - digits]


class EngineFigures:
    """What the engine reports, summed over a measurement: each `report()` hands over (drains) the
    worker's busy turns (`step_seconds`) and the loaders' store → host read+decode seconds."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        engine.report()  # what came before (start-up, an earlier measurement) is not ours
        self.step_seconds = 0.0
        self.steps = 0
        self.load_seconds: list[float] = []

    def drain(self) -> None:
        report = self.engine.report()
        self.step_seconds += sum(report["step_seconds"])
        self.steps += len(report["step_seconds"])
        self.load_seconds += report["load_seconds"]

    def progress(self, done: int) -> None:
        """A sweep's progress callback: drain now and then (the worker keeps its last 10,000 turns only)."""
        if done % 1000 == 0:
            self.drain()


def worker_cpu_seconds() -> float | None:
    """CPU seconds of the engine's worker thread ("mint-engine") so far: its steps' compute (all of it
    with --threads 1; OpenMP helper threads are not counted); None off Unix."""
    worker = next((t for t in threading.enumerate() if t.name == "mint-engine"), None)
    if worker is None or worker.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    return time.clock_gettime(time.pthread_getcpuclockid(worker.ident))


def process_io() -> dict[str, int]:
    """This process's bytes read so far: `rchar` (every read call, page cache hits too) and `read_bytes`
    (from the disk); empty where /proc/self/io is missing."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    fields = dict(line.split(": ") for line in text.splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 in ms (nearest rank: of 40 samples, p99 is the largest)."""
    ordered = sorted(seconds)
    if not ordered:
        return {"n": 0}
    at = lambda q: ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]  # noqa: E731
    return {"n": len(ordered), "p50_ms": 1e3 * at(0.5), "p99_ms": 1e3 * at(0.99)}


def sweep_cost(ctx: ScaleOutContext) -> dict[str, Any] | None:
    """`mint sweep`'s loop (cli.sweep.run_sweep: one short prompt a policy, max_tokens 1, scores stored
    as evals) over the first N servable policies for each N in ctx.extra["sweep_sizes"], each starting
    with no catalog adapter loaded: adapters/s, process CPU per adapter, the ratio of cost per adapter at the largest N to the
    smallest, payload bytes/s against the disk's read rate, and the fraction of wall time the engine's
    worker spent in turns that ran work."""
    from mint_server.cli.sweep import run_sweep
    from mint_server.engine.values import REVISION_KEY_PREFIX

    sizes = [n for n in ctx.extra.get("sweep_sizes", (100, 1000)) if n <= ctx.servable_count]
    if not sizes:
        return None
    payload_bytes = ctx.servable.resolve(ctx.owner, policy_name(0)).size
    runs: list[dict[str, Any]] = []
    engine = ctx.engine()
    for n in sizes:
        engine.forget_source(REVISION_KEY_PREFIX).result()
        figures = EngineFigures(engine)
        metric = f"bench-sweep-{uuid.uuid4().hex[:8]}"  # fresh: a rerun on a reused catalog skips nothing
        out = ctx.workdir / "sweeps" / metric
        io_before, worker_before = process_io(), worker_cpu_seconds()
        with measured() as m:
            counts = run_sweep(engine, ctx.servable, ctx.owner, [PROMPT], block_prefix(0, n), "prod", 1, metric,
                               out, SWEEP_WINDOW, figures.progress)
        figures.drain()
        io_after, worker_after = process_io(), worker_cpu_seconds()
        shutil.rmtree(out, ignore_errors=True)
        active = max(1e-9, m["seconds"] - m["paused_seconds"])
        loads = sorted(figures.load_seconds)
        run = {"policies": n, **counts, **m, "adapters_per_s": n / m["seconds"], "adapters_per_active_s": n / active,
               "cpu_ms_per_adapter": 1e3 * m["cpu_seconds"] / n, "active_ms_per_adapter": 1e3 * active / n,
               "payload_MBps": n * payload_bytes / m["seconds"] / 1e6,
               "step_fraction": figures.step_seconds / m["seconds"], "steps": figures.steps,
               "worker_cpu_fraction": (worker_after - worker_before) / m["seconds"]
               if worker_before is not None and worker_after is not None else None,
               "loads": len(loads), "load_ms_p50": 1e3 * loads[len(loads) // 2] if loads else None,
               "load_average": load_average()}
        if io_before:
            run["read_call_MBps"] = (io_after["rchar"] - io_before["rchar"]) / m["seconds"] / 1e6
            run["disk_read_MBps"] = (io_after["read_bytes"] - io_before["read_bytes"]) / m["seconds"] / 1e6
        runs.append(run)
        print(f"  sweep {n:,}: {run['adapters_per_s']:,.1f} adapters/s ({run['adapters_per_active_s']:,.1f} running), "
              f"{run['cpu_ms_per_adapter']:.1f} ms CPU/adapter, payload {run['payload_MBps']:.2f} MB/s "
              f"(disk reads {run.get('disk_read_MBps', 0):.2f} MB/s), engine busy {run['step_fraction']:.0%} "
              f"of the wall (worker CPU {run['worker_cpu_fraction'] or 0:.0%}), {counts}   (load {run['load_average']})", flush=True)
    first, last = runs[0], runs[-1]
    disk = ctx.extra.get("disk", {})
    return {"runs": runs, "payload_bytes_per_adapter": payload_bytes,
            "cpu_cost_ratio_largest_vs_smallest": last["cpu_ms_per_adapter"] / first["cpu_ms_per_adapter"],
            "active_cost_ratio_largest_vs_smallest": last["active_ms_per_adapter"] / first["active_ms_per_adapter"],
            "payload_over_disk_read": last["payload_MBps"] / disk["read_MBps"] if disk.get("read_MBps") else None}


def cold_load_breakdown(catalog: Any, owner: str, names: list[str], engine: Any) -> dict[str, Any]:
    """The stages of a cold load, each timed on this thread for never-loaded policies: catalog lookup
    (resolve @prod), blob read (verified payload), decode (load_peft_files, what a loader thread runs)
    and the copy into a slot (a one-slot bank of the engine's shapes, dtype and device, written as the
    residency writes one)."""
    from mint_server.model.lora import LoraBank
    from mint_server.model.peft_io import load_peft_files

    cfg = engine.model.config
    bank = LoraBank(cfg, 1, engine.settings.max_rank, engine.device, engine.dtype)
    sync = torch_sync(engine.device)
    stages: dict[str, list[float]] = {"lookup": [], "read": [], "decode": [], "copy_to_slot": []}
    for name in names:
        t0 = time.perf_counter()
        revision = catalog.resolve(owner, f"{name}@prod")
        t1 = time.perf_counter()
        files = catalog.read_payload(revision)
        t2 = time.perf_counter()
        weights = load_peft_files(files, cfg)
        host = {t: (a.float(), b.float()) for t, (a, b) in weights.weights.items()}  # the host tier's copy
        t3 = time.perf_counter()
        bank.write(0, {t: (a.to(engine.device), b.to(engine.device)) for t, (a, b) in host.items()},
                   weights.rank, weights.alpha)
        sync()
        t4 = time.perf_counter()
        for stage, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            stages[stage].append(seconds)
    return {stage: percentiles(seconds) for stage, seconds in stages.items()}


def torch_sync(device: Any) -> Callable[[], None]:
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def print_ttft(case: str, figures: dict[str, Any]) -> None:
    """One case's line, as soon as it is measured; adds the ratio cold p99 / hot p99 to `figures`."""
    cold, hot = figures["cold"], figures["hot"]
    figures["cold_p99_over_hot_p99"] = cold["p99_ms"] / hot["p99_ms"]
    print(f"  ttft {case}: cold p50 {cold['p50_ms']:.1f} / p99 {cold['p99_ms']:.1f} ms, hot p50 {hot['p50_ms']:.1f} / "
          f"p99 {hot['p99_ms']:.1f} ms, cold p99 / hot p99 {figures['cold_p99_over_hot_p99']:.2f}; loaders' read+decode "
          f"p50 {figures['loader_read_decode'].get('p50_ms', 0):.1f} ms   (load {figures['load_average']})", flush=True)


def ttft_cold_hot(ctx: ScaleOutContext) -> dict[str, Any] | None:
    """Time to first token (max_tokens 1, one short prompt) on one engine reading catalog revisions as
    `mint serve` does (a lookup per request, cli.sweep.revision_source): requests on random COLD
    policies (never loaded: store → host → device) alternate with requests on a HOT one (in a slot),
    one at a time, (a) on an idle engine and (b) while `mint sweep`'s loop runs over other policies
    on the same engine; p50/p99 of each, the ratio cold p99 / hot p99, and a cold load's stages.

    Policies by index: 0 is the hot one; the first half of the catalog (past block 0) holds the cold
    ones; the sweep cycles through the second half."""
    import random

    from tinker import types

    from mint_server.cli.sweep import revision_source, run_sweep
    from mint_server.engine.values import REVISION_KEY_PREFIX

    n = ctx.servable_count
    requests = ctx.extra.get("ttft_requests", 40)
    block = 10 ** (len(str(max(1, n // 10))) - 1)
    blocks = n // block
    cold_pool = list(range(block, (blocks // 2) * block))
    if blocks < 4 or len(cold_pool) < 2 * requests + 20:
        return {"skipped": f"{n} servable policies: too few for {requests} cold requests twice and a sweep"}
    picks = random.Random(0).sample(cold_pool, 2 * requests + 20)
    cold = {"idle": [policy_name(i) for i in picks[:requests]],
            "under_sweep": [policy_name(i) for i in picks[requests: 2 * requests]]}
    breakdown_names = [policy_name(i) for i in picks[2 * requests:]]
    hot = policy_name(0)
    params = types.SamplingParams(max_tokens=1, temperature=0.0)
    catalog, owner = ctx.servable, ctx.owner
    engine = ctx.engine()
    engine.forget_source(REVISION_KEY_PREFIX).result()
    prompt = engine.tokenizer(PROMPT)["input_ids"]

    def first_token(name: str) -> float:
        t0 = time.perf_counter()
        revision = catalog.resolve(owner, f"{name}@prod")
        engine.submit(engine.prepare_sample(revision_source(catalog, revision), prompt, 1, params,
                                            key="ttft")).result()
        return time.perf_counter() - t0

    def alternate(cold_names: list[str]) -> tuple[list[float], list[float]]:
        cold_s, hot_s = [], []
        for name in cold_names:
            cold_s.append(first_token(name))
            hot_s.append(first_token(hot))
        return cold_s, hot_s

    for _ in range(3):  # the hot policy into its slot; the first steps' one-off costs out of the figures
        first_token(hot)
    out: dict[str, Any] = {"requests": requests, "sweep_window": SWEEP_WINDOW}
    figures = EngineFigures(engine)
    cold_s, hot_s = alternate(cold["idle"])
    figures.drain()
    out["idle"] = {"cold": percentiles(cold_s), "hot": percentiles(hot_s),
                   "loader_read_decode": percentiles(figures.load_seconds), "load_average": load_average()}
    print_ttft("idle", out["idle"])

    stop, started = threading.Event(), threading.Event()
    failed: list[BaseException] = []
    swept = [0]
    sweep_blocks = [block_prefix(b * block, block) for b in range(blocks // 2, blocks)]

    def progress(done: int) -> None:
        swept[0] += 1
        if swept[0] >= SWEEP_WINDOW:  # the window is full: the engine is busy with the sweep
            started.set()

    def sweep() -> None:
        try:
            while not stop.is_set():  # a pass, then another (metric fresh) until the measurement ends
                metric = f"bench-ttft-{uuid.uuid4().hex[:8]}"
                for prefix in sweep_blocks:
                    if stop.is_set():
                        break
                    run_sweep(engine, catalog, owner, [PROMPT], prefix, "prod", 1, metric,
                              ctx.workdir / "sweeps" / metric, SWEEP_WINDOW, progress)
                shutil.rmtree(ctx.workdir / "sweeps" / metric, ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - reported on the measuring thread
            failed.append(e)
        finally:
            started.set()  # never leave the measurement waiting

    thread = threading.Thread(target=sweep, name="bench-sweep", daemon=True)
    figures = EngineFigures(engine)
    thread.start()
    started.wait()
    swept_before = swept[0]
    with measured() as m:
        cold_s, hot_s = alternate(cold["under_sweep"])
    stop.set()
    thread.join()
    if failed:
        raise RuntimeError("the sweep under the measurement failed") from failed[0]
    figures.drain()
    out["under_sweep"] = {"cold": percentiles(cold_s), "hot": percentiles(hot_s),
                          "sweep_policies_during": swept[0] - swept_before, "seconds": m["seconds"],
                          "paused_seconds": m["paused_seconds"],
                          "loader_read_decode": percentiles(figures.load_seconds),
                          "load_average": load_average()}
    print_ttft("under_sweep", out["under_sweep"])
    out["breakdown"] = cold_load_breakdown(catalog, owner, breakdown_names, engine)
    print("  cold load stages (p50 ms): " + ", ".join(f"{k} {v['p50_ms']:.2f}" for k, v in out["breakdown"].items()),
          flush=True)
    return out


def fleet_wave_ratio(ctx: ScaleOutContext) -> dict[str, Any] | None:
    """`mint serve --ray` on one machine: a fleet of 2 replicas vs one of 1 (each replica a Ray actor
    pinned to its own core, one torch thread), side by side, waves alternating, each wave
    `--wave` distinct cold catalog policies (never loaded by that fleet: the router checks each
    revision out into the shared dir, a replica loads it) with one short greedy request each, all
    submitted at once. Sampled tokens/s on 2 vs 1 (medians; goal ≥ 1.7), each replica's CPU seconds
    (`cpu_scaling`: one replica's CPU for a wave / the busier of two's, the scaling their own work
    allows when each has a free core), then the last wave again on 2 replicas, now hot: the share
    served by its home replica, and the requests sent elsewhere (each would load its adapter on a
    second replica)."""
    import ray

    from benchmarks.cluster import process_cpu, wave
    from mint_server.cli.serve import base_model_name
    from mint_server.cli.sweep import revision_source
    from mint_server.engine.fleet import FleetEngine
    from mint_server.engine.settings import EngineSettings, FleetSettings

    size, rounds = ctx.extra.get("wave", 1000), ctx.extra.get("wave_rounds", 2)
    first = ctx.servable_count // 2  # clear of the sweeps' and ttft's first blocks
    if ctx.servable_count - first < (2 * rounds + 1) * size:
        return {"skipped": f"{ctx.servable_count} servable policies: too few for {2 * rounds} cold waves of {size}"}
    catalog, owner = ctx.servable, ctx.owner

    def sources(start: int, count: int) -> list[Any]:
        return [revision_source(catalog, catalog.resolve(owner, f"{policy_name(i)}@prod"))
                for i in range(start, start + count)]

    # Three replicas at once on one machine: a KV pool and host cache sized for a wave of short
    # requests, not the defaults' (3 GB of SmolLM2 KV each).
    settings = EngineSettings(store_dir=ctx.workdir / "fleet" / "pages", device_slots=64, kv_budget_tokens=16384,
                              host_cache_mb=512.0)
    name = base_model_name(str(ctx.model_dir), ctx.model_dir)
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 * MiB, log_to_driver=False)
    fleets: dict[int, Any] = {}
    out: dict[str, Any] = {"wave": size, "rounds": rounds, "load_average_start": load_average()}
    try:
        for n in (1, 2):
            fleets[n] = FleetEngine(ctx.model_dir, name, settings=settings,
                                    fleet=FleetSettings(replicas=n, pin_cores=True, cpus_per_replica=1))
            wave(fleets[n], sources(first, 16), 4)  # first steps, checkouts of the warm-up policies
        runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
        start = first + 16
        for rnd in range(rounds):
            for n in (1, 2):
                fleet, batch = fleets[n], sources(start, size)
                start += size
                pids = fleet.replica_pids()
                cpu0 = [process_cpu(p) for p in pids]
                seconds, tokens = wave(fleet, batch, 4)
                cpu = [process_cpu(p) - c for p, c in zip(pids, cpu0, strict=True)]
                runs[n].append({"seconds": seconds, "tokens_per_s": tokens / seconds, "replica_cpu_s": cpu,
                                "sources": batch})
                print(f"  round {rnd}, {n} replica(s): {size:,} cold catalog policies in {seconds:.1f} s, "
                      f"{tokens / seconds:.1f} sampled tokens/s, replica CPU s {[round(c, 1) for c in cpu]}   "
                      f"(load {load_average()})", flush=True)
        for n in (1, 2):
            out[f"tokens_per_s_{n}"] = statistics.median(r["tokens_per_s"] for r in runs[n])
            out[f"replica_cpu_s_{n}"] = [statistics.median(r["replica_cpu_s"][i] for r in runs[n]) for i in range(n)]
        out["wave_ratio"] = out["tokens_per_s_2"] / out["tokens_per_s_1"]
        out["cpu_scaling"] = out["replica_cpu_s_1"][0] / max(out["replica_cpu_s_2"])
        fleet = fleets[2]
        before = dict(fleet.routed)
        wave(fleet, runs[2][-1]["sources"], 4)  # the 2-replica fleet's last wave again: hot now
        routed = {k: v - before.get(k, 0) for k, v in fleet.routed.items()}
        total = sum(routed.values())
        home = sum(v for (_, decision), v in routed.items() if decision == "home")
        out.update(affinity_hit_rate=home / total, hot_requests_off_home=total - home,
                   requests_per_replica=[sum(v for (r, _), v in routed.items() if r == i) for i in range(2)],
                   load_average=load_average())
        print(f"  2 vs 1 replica: {out['wave_ratio']:.2f}x sampled tokens/s (goal >= 1.7), {out['cpu_scaling']:.2f}x by "
              f"replica CPU; hot wave: {home}/{total} on their home replica, {total - home} elsewhere   "
              f"(load {out['load_average']})", flush=True)
    finally:
        for fleet in fleets.values():
            fleet.shutdown()
        ray.shutdown()
    return out


HOOKS: dict[str, Callable[[ScaleOutContext], dict[str, Any] | None]] = {
    hook.__name__: hook for hook in (sweep_cost, ttft_cold_hot, fleet_wave_ratio)
}


# -- S3 clients ----------------------------------------------------------------------------------
def compare_s3_clients(rounds: int = 3) -> dict[str, float]:
    """MB/s of obstore and s3fs against a local moto S3 server, per operation (best of `rounds`): the
    measurement behind the choice of obstore for the S3 blob store."""
    import obstore
    import s3fs
    from obstore.store import S3Store

    from tests.s3 import CREDENTIALS, new_bucket, s3_server

    small = [os.urandom(250_000) for _ in range(100)]
    big, mid = os.urandom(64 * MiB), os.urandom(8 * MiB)
    out: dict[str, float] = {}
    with s3_server() as endpoint:
        bucket = new_bucket(endpoint)
        ob = S3Store(bucket, endpoint=endpoint, allow_http=True, region=CREDENTIALS["AWS_DEFAULT_REGION"],
                     access_key_id="test", secret_access_key="test")
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="test", secret="test")
        fs.pipe_file(f"{bucket}/f/mid", mid)
        obstore.put(ob, "o/mid", mid)
        cases: dict[str, tuple[Callable[[], object], int]] = {
            "obstore_put_250KB": (lambda: [obstore.put(ob, f"o/s{i}", d) for i, d in enumerate(small)], 25_000_000),
            "s3fs_put_250KB": (lambda: [fs.pipe_file(f"{bucket}/f/s{i}", d) for i, d in enumerate(small)], 25_000_000),
            "obstore_get_250KB": (lambda: [obstore.get(ob, f"o/s{i}").bytes() for i in range(100)], 25_000_000),
            "s3fs_get_250KB": (lambda: [fs.cat_file(f"{bucket}/f/s{i}") for i in range(100)], 25_000_000),
            "obstore_put_64MB": (lambda: obstore.put(ob, "o/big", big, use_multipart=False), 64 * MiB),
            "s3fs_put_64MB": (lambda: fs.pipe_file(f"{bucket}/f/big", big), 64 * MiB),
            "obstore_get_64MB": (lambda: obstore.get(ob, "o/big").bytes(), 64 * MiB),
            "s3fs_get_64MB": (lambda: fs.cat_file(f"{bucket}/f/big"), 64 * MiB),
            "obstore_range_250KB": (lambda: [obstore.get_range(ob, "o/mid", start=i * 250_000, length=250_000)
                                             for i in range(30)], 7_500_000),
            "s3fs_range_250KB": (lambda: [fs.cat_file(f"{bucket}/f/mid", start=i * 250_000, end=(i + 1) * 250_000)
                                          for i in range(30)], 7_500_000),
        }
        for label, (fn, nbytes) in cases.items():
            best = min(_timed(fn) for _ in range(rounds))
            out[f"{label}_MBps"] = nbytes / best / 1e6
    for op in ("put_250KB", "get_250KB", "put_64MB", "get_64MB", "range_250KB"):
        out[f"obstore_over_s3fs_{op}"] = out[f"obstore_{op}_MBps"] / out[f"s3fs_{op}_MBps"]
    return out


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- extrapolation -------------------------------------------------------------------------------
# Attention shapes from the models' published config.json files (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, head_dim).
MODELS = {
    "SmolLM2-135M": (576, 30, 9, 3, 64),
    "Qwen3-8B": (4096, 36, 32, 8, 128),
    "Qwen3-30B-A3B": (2048, 48, 32, 4, 128),
}


def adapter_tensor_bytes(model: str, rank: int, targets: tuple[str, ...]) -> int:
    """fp32 bytes of a LoRA adapter's A and B on `targets` in every layer."""
    hidden, layers, heads, kv_heads, head_dim = MODELS[model]
    io = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
          "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
    return 4 * layers * rank * sum(sum(io[t]) for t in targets)


def extrapolate(per_record: float, per_revision_rows: float, header_per_tensor: float,
                index_per_blob: float) -> list[dict[str, Any]]:
    """Disk and memory at 10^6 and 10^7 policies, each policy one revision with its own adapter:
    catalog rows (measured bytes per record + the revision's manifest rows), blob bytes (tensors +
    safetensors header, measured per tensor), host cache per resident adapter (fp32 tensors) and
    the pack index every reading process holds (measured bytes per blob)."""
    rows = []
    for model in MODELS:
        layers = MODELS[model][1]
        for rank, targets in ((1, ("q_proj", "v_proj")), (16, ("q_proj", "k_proj", "v_proj", "o_proj"))):
            tensors = adapter_tensor_bytes(model, rank, targets)
            blob = tensors + header_per_tensor * 2 * len(targets) * layers
            for n in (10**6, 10**7):
                rows.append({
                    "model": model, "rank": rank, "targets": "+".join(t[0] for t in targets), "policies": n,
                    "catalog_GB": n * (per_record + per_revision_rows) / 1e9, "blobs_GB": n * blob / 1e9,
                    "host_cache_MB_per_adapter": tensors / 1e6, "pack_index_MB": n * index_per_blob / 1e6,
                })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| model | LoRA | policies | catalog DB | blobs | host cache / resident adapter | pack index / process |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | r{r['rank']} {r['targets']} | 10^{len(str(r['policies'])) - 1} | {r['catalog_GB']:.2f} GB | "
              f"{_gb(r['blobs_GB'])} | {r['host_cache_MB_per_adapter']:.3f} MB | {r['pack_index_MB']:.0f} MB |")


def _gb(value: float) -> str:
    return f"{value / 1000:.1f} TB" if value >= 1000 else f"{value:.1f} GB"


# -- main ----------------------------------------------------------------------------------------
def seed_and_measure(args: argparse.Namespace, result: dict[str, Any], servable: Any, records: Any, workdir: Path,
                     model_dir: Path) -> dict[str, Any]:
    """Sections 2 and 3: seed both catalogs (rates into `result`), then measure bytes per policy; returns those."""
    if args.baseline:
        base = one_fsync_per_blob(workdir, args.baseline, model_dir)
        result["one_fsync_per_blob"] = base
    sv = seed_servable(servable, args.servable, model_dir, args.servable_batch)
    result["servable"] = sv
    print(f"servable seed: {sv['adapters']:,} adapters in {sv['seconds']:,.1f}s = "
          f"{sv['adapters_per_s']:,.0f} adapters/s ({sv['blob_MBps']:,.1f} MB/s of blobs); "
          f"{sv['paused_seconds']:,.0f}s of it paused, {sv['adapters_per_active_s']:,.0f} adapters/s running; "
          f"{sv['cpu_ms_per_adapter']:.2f} ms CPU per adapter"
          + (f"; one fsync'd blob each: {base['adapters_per_s']:,.0f} adapters/s "
             f"(bulk {sv['adapters_per_s'] / base['adapters_per_s']:.1f}x)" if args.baseline else "")
          + f"   (load {sv['load_average']})", flush=True)
    rec = seed_records(records, args.records, args.records_batch)
    result["records"] = rec
    print(f"records seed: {rec['policies']:,} policies ({rec['rows']:,} rows) in {rec['seconds']:,.1f}s = "
          f"{rec['policies_per_s']:,.0f} policies/s, {rec['rows_per_s']:,.0f} rows/s; "
          f"{rec['paused_seconds']:,.0f}s paused; {rec['cpu_us_per_policy']:.0f} µs CPU per policy   "
          f"(load {rec['load_average']})", flush=True)

    host = host_bytes_per_adapter(servable, model_dir)
    servable.blobs.refresh()
    packed_blobs = sum(len(p.blobs) for p in servable.blobs.iter_packs())
    sizes = {
        "catalog_bytes_per_policy_record": rec["catalog_bytes"] / max(1, args.records),
        "catalog_bytes_per_servable_policy": sv["catalog_bytes"] / max(1, args.servable),
        "blob_bytes_per_adapter_revision": sv["blob_bytes"] / max(1, args.servable),
        **host,
        "pack_index_bytes_per_blob": servable.blobs.index_bytes(compact=True) / max(1, packed_blobs)
        if hasattr(servable.blobs, "index_bytes") else None,
    }
    result["bytes"] = sizes
    print(f"bytes: {sizes['catalog_bytes_per_policy_record']:,.0f} B catalog per policy record; "
          f"{sizes['catalog_bytes_per_servable_policy'] + sizes['blob_bytes_per_adapter_revision']:,.0f} B "
          f"per servable revision (catalog {sizes['catalog_bytes_per_servable_policy']:,.0f} + blobs "
          f"{sizes['blob_bytes_per_adapter_revision']:,.0f}); host cache {host['host_cache_bytes_per_adapter']:,} B "
          f"per resident adapter; pack index {sizes['pack_index_bytes_per_blob'] or 0:.0f} B per blob", flush=True)
    return sizes


def _names(value: str) -> list[str]:
    return [name for name in value.split(",") if name]


def _sizes(value: str) -> list[int]:
    return sorted(int(n) for n in value.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servable", type=int, default=1000, help="servable SmolLM2 adapters to seed")
    parser.add_argument("--records", type=int, default=10_000, help="record-only policies to seed (4 rows each)")
    parser.add_argument("--servable-batch", type=int, default=1000)
    parser.add_argument("--records-batch", type=int, default=10_000)
    parser.add_argument("--baseline", type=int, default=200, help="adapters written one fsync'd blob each")
    parser.add_argument("--workdir", type=Path, default=None, help="where catalogs and blobs go (temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (e.g. for the engine hooks)")
    parser.add_argument("--db-url", default=None, help="PostgreSQL URL (a fresh schema); default SQLite")
    parser.add_argument("--store", default=None, help="blob store URL (default: under the workdir)")
    parser.add_argument("--model", type=Path, default=None, help="SmolLM2 dir (default: the prepared one)")
    parser.add_argument("--compare-s3-clients", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the extrapolation table (docs/scale-out.md)")
    parser.add_argument("--reuse", action="store_true",
                        help="--workdir already holds the seeded catalogs (a run with --keep): skip seeding and bytes")
    parser.add_argument("--hooks", type=_names, default=list(HOOKS),
                        help=f"engine-side hooks to run, comma-separated (default all: {','.join(HOOKS)}; '' for none)")
    parser.add_argument("--sweep-sizes", type=_sizes, default=[100, 1000],
                        help="sweep_cost: policies per sweep, powers of ten up to --servable (default 100,1000)")
    parser.add_argument("--ttft-requests", type=int, default=40, help="ttft_cold_hot: cold (and hot) requests per case")
    parser.add_argument("--wave", type=int, default=1000, help="fleet_wave_ratio: distinct cold policies per wave")
    parser.add_argument("--wave-rounds", type=int, default=2, help="fleet_wave_ratio: waves per fleet")
    parser.add_argument("--threads", type=int, default=None,
                        help="the hooks' engine: intra-op threads (`mint serve --threads`; default the cores it may use)")
    args = parser.parse_args()
    if any(n < 1 or 10 ** (len(str(n)) - 1) != n for n in args.sweep_sizes):
        parser.error(f"--sweep-sizes: powers of ten (one name prefix selects each sweep), got {args.sweep_sizes}")
    if unknown := set(args.hooks) - set(HOOKS):
        parser.error(f"--hooks: no hook {sorted(unknown)}; the hooks are {','.join(HOOKS)}")
    reuse = args.reuse and args.workdir is not None and (args.workdir / "servable").is_dir() \
        and (args.workdir / "records").is_dir()
    if args.reuse and args.db_url is not None:
        parser.error("--reuse: the catalog is on SQLite in the workdir (--db-url seeds a fresh schema)")
    if reuse and args.table:
        parser.error("--table needs the seeding figures: leave out --reuse")

    model_dir = args.model or smollm2_dir()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mint-scale-out-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"load_average_start": load_average(), "cpus": os.cpu_count(), "reused": reuse}
    try:
        disk = disk_rates(workdir)
        result["disk"] = disk
        print(f"disk ({workdir}): write {disk['write_MBps']:,.0f} MB/s, read {disk['read_MBps']:,.0f} MB/s"
              f"{'' if disk['read_direct'] else ' (page cache: no O_DIRECT here)'}, "
              f"{disk['fsynced_small_files_per_s']:,.0f} fsync'd small files/s   (load {load_average()})",
              flush=True)
        if args.compare_s3_clients:
            result["s3_clients"] = compare_s3_clients()
            print("s3 clients (MB/s, obstore/s3fs): " + ", ".join(
                f"{op} {result['s3_clients'][f'obstore_over_s3fs_{op}']:.2f}x"
                for op in ("put_250KB", "get_250KB", "put_64MB", "get_64MB", "range_250KB")), flush=True)
        with catalog_at(workdir / "servable", args.db_url, args.store) as servable, \
                catalog_at(workdir / "records", args.db_url, None) as records:
            if reuse:
                from mint_server.catalog.seed import next_index

                servable_count, records_count = next_index(servable, OWNER, "sv-"), next_index(records, OWNER, "rec-")
                print(f"reused {workdir}: {servable_count:,} servable policies, {records_count:,} records", flush=True)
            else:
                servable_count, records_count = args.servable, args.records
                sizes = seed_and_measure(args, result, servable, records, workdir, model_dir)

            ctx = ScaleOutContext(model_dir, workdir, servable, records, servable_count, records_count,
                                  extra={"disk": disk, "sweep_sizes": args.sweep_sizes,
                                         "ttft_requests": args.ttft_requests, "threads": args.threads,
                                         "wave": args.wave, "wave_rounds": args.wave_rounds})
            result["hooks"] = {}
            try:
                for name in args.hooks:
                    print(f"{name}: (load {load_average()})", flush=True)
                    value = result["hooks"][name] = HOOKS[name](ctx)
                    if value is None:
                        print(f"{name}: not measured here", flush=True)
            finally:
                ctx.close()
            if args.table:
                weights = servable.read_payload(servable.resolve(OWNER, "sv-000000000"))["adapter_model.safetensors"]
                header = int.from_bytes(weights[:8], "little") + 8
                tensors = len(json.loads(weights[8:header])) - 1
                manifest_rows = sizes["catalog_bytes_per_servable_policy"] - sizes["catalog_bytes_per_policy_record"]
                table = extrapolate(sizes["catalog_bytes_per_policy_record"], max(0.0, manifest_rows),
                                    header / tensors, sizes["pack_index_bytes_per_blob"] or 48.0)
                result["extrapolation"] = table
                print_table(table)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result["load_average_end"] = load_average()
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
