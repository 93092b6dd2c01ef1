"""Scale Out at the seed's scale (a script, not a test): bulk seeding, bytes per policy, and the hooks
the engine side fills (sweep cost per adapter, cold vs hot first token, fleet wave ratio).

    .venv/bin/python -m benchmarks.scale_out                                    # CI size: 1K servable, 10K records
    nice -n 19 .venv/bin/python -m benchmarks.scale_out --servable 100000 --records 1000000 --workdir /big/dir
    … --db-url postgresql+psycopg://…        # the catalog on PostgreSQL (a fresh schema per run)
    … --store s3://bucket/prefix             # blobs on S3 (AWS_* env vars); default <workdir>/…/blobs
    … --compare-s3-clients                   # obstore vs s3fs throughput against a local moto server

Prints, in order:
  1. the disk under --workdir: sequential write (fsync'd) and O_DIRECT read MB/s, and small fsync'd
     files per second (what one-fsync-per-blob seeding was bound by);
  2. seeding: servable SmolLM2 adapters/s (rank 1 on q,v, fp32: what the catalog stores) through the
     bulk path, beside the same adapters written one fsync'd blob each (the old path, on a sample);
     catalog records/s (each policy is 4 rows: policy, revision, alias, alias event);
  3. bytes: catalog bytes per policy record, catalog + blob bytes per adapter revision, host-cache
     bytes per resident adapter (the fp32 weights the residency host tier keeps) and pack-index bytes
     per blob (the in-memory map every reading process keeps);
  4. the engine-side hooks (None until filled in: see `hooks`);
and last one JSON line with everything. The load average is printed with the figures: the machine
is shared, so rates are floors of what the code does on an idle one.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
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
    """A fresh catalog: SQLite in `data_dir`, or a fresh schema of the PostgreSQL database at db_url."""
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
    from mint_server.catalog.blobs import LocalBlobStore
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


def sweep_cost(ctx: ScaleOutContext) -> dict[str, Any] | None:
    """Engine side: `mint sweep` cost per adapter at 1K / 10K / 100K (ratio vs 1K), adapters/s, bytes read/s
    vs the disk's read rate, fraction of time the engine computes."""
    return None


def ttft_cold_hot(ctx: ScaleOutContext) -> dict[str, Any] | None:
    """Engine side: TTFT of a random cold policy (store → host → device) vs a hot one, p50/p99, idle and
    under a sweep, with its breakdown (lookup, read, decode, copy to slot)."""
    return None


def fleet_wave_ratio(ctx: ScaleOutContext) -> dict[str, Any] | None:
    """Engine side: tokens/s of 2 Ray replicas vs 1 on a wave of 1,000 distinct adapters, affinity hit
    rate, adapters loaded on both replicas."""
    return None


HOOKS: dict[str, Callable[[ScaleOutContext], dict[str, Any] | None]] = {
    "sweep": sweep_cost, "ttft": ttft_cold_hot, "fleet_wave": fleet_wave_ratio,
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
    args = parser.parse_args()

    model_dir = args.model or smollm2_dir()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mint-scale-out-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"load_average_start": load_average(), "cpus": os.cpu_count()}
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

            ctx = ScaleOutContext(model_dir, workdir, servable, records, args.servable, args.records)
            result["hooks"] = {name: hook(ctx) for name, hook in HOOKS.items()}
            for name, value in result["hooks"].items():
                print(f"{name}: {value if value is not None else 'not measured here (engine side)'}", flush=True)
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
