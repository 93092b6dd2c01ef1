"""Catalog lookup latency versus catalog size (a script, not a test).

Seeds a fresh catalog per size (10^3, 10^5, 10^6 synthetic policies, each with a revision chain
and a `prod` alias) and measures, through the Catalog API:

  * alias resolve      resolve(owner, "NAME@prod")      random policies
  * revision lookup    get_revision(owner, NAME, N)     random policies and revision numbers
  * middle page        list_policies(limit=100) starting mid-listing (keyset cursor, no OFFSET)
  * seeding rate       policies/s while seeding that catalog

Lookups are interleaved across the sizes in short rounds, so noise from the rest of the machine
hits every size alike.

    .venv/bin/python -m benchmarks.catalog                       # SQLite (+ PostgreSQL if MINT_TEST_POSTGRES_URL)
    .venv/bin/python -m benchmarks.catalog --pg-url postgresql+psycopg://... --sizes 1000,100000

Prints a table and, last, one JSON line. The goal is p99 at the largest size within 1.5x of p99
at the smallest: every lookup is an index probe, so latency should not grow with the catalog.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from mint_server.catalog import Catalog
from mint_server.catalog import cursor as cursors
from mint_server.catalog import seed as seeding
from mint_server.catalog.seed import DIGITS

OWNER = "bench"
PREFIX = "bench-"


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3  # µs

    return {
        "p50_us": at(0.50),
        "p99_us": at(0.99),
        "mean_us": statistics.fmean(ordered) / 1e3,
        "n": len(ordered),
    }


def timed(fn: Callable[[int], object], args: list[int], into: list[int]) -> None:
    for arg in args:
        t0 = time.perf_counter_ns()
        fn(arg)
        into.append(time.perf_counter_ns() - t0)


@contextmanager
def fresh_database(backend: str, pg_url: str | None, workdir: Path, size: int) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{workdir / f'catalog-{size}.db'}"
        return
    assert pg_url
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield (
            make_url(pg_url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False)
        )
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def name(i: int) -> str:
    return f"{PREFIX}{i:0{DIGITS}d}"


def probes(catalog: Catalog, k: int) -> dict[str, Callable[[int], object]]:
    def page(i: int) -> None:
        # A cursor positioned mid-listing, as if the caller had paged this far.
        items = catalog.list_policies(OWNER, cursor=cursors.encode("policies", name(i)), limit=100).items
        assert len(items) == 100

    return {
        "resolve": lambda i: catalog.resolve(OWNER, f"{name(i)}@prod"),
        "revision_lookup": lambda i: catalog.get_revision(OWNER, name(i), 1 + i % k),
        "middle_page_100": page,
    }


def run_backend(
    backend: str, urls: dict[int, str], workdir: Path, k: int, lookups: int
) -> list[dict[str, Any]]:
    """One catalog per size, then measurements interleaved across sizes in short rounds, so that
    load from anything else on the machine lands on every size alike instead of on one."""
    rng = random.Random(1234)
    with ExitStack() as stack:
        catalogs, rates = {}, {}
        for size, url in urls.items():
            catalog = stack.enter_context(Catalog.open(url, data_dir=workdir / f"data-{size}"))
            started = time.perf_counter()
            seeding.seed(catalog, size, k, OWNER, prefix=PREFIX, batch_size=20_000)
            rates[size] = size / (time.perf_counter() - started)
            catalogs[size] = catalog
        samples: dict[int, dict[str, list[int]]] = {size: {} for size in urls}
        rounds = max(1, lookups // 100)
        for round_no in range(rounds + 1):  # round 0 warms caches and is discarded
            order = list(urls)
            rng.shuffle(order)
            for size in order:
                middle = size // 2
                for metric, fn in probes(catalogs[size], k).items():
                    if metric == "middle_page_100":
                        args = [rng.randrange(max(0, middle - 1000), middle) for _ in range(10)]
                    else:
                        args = [rng.randrange(size) for _ in range(100)]
                    into = samples[size].setdefault(metric, []) if round_no else []
                    gc.collect()
                    gc.disable()  # a collection inside a sample would time the collector
                    try:
                        timed(fn, args, into)
                    finally:
                        gc.enable()
    rows = []
    for size in urls:
        row: dict[str, Any] = {"backend": backend, "policies": size, "revisions_per_policy": k}
        row["seed_policies_per_s"] = rates[size]
        row.update({metric: percentiles(values) for metric, values in samples[size].items()})
        rows.append(row)
        print_row(row)
    return rows


def print_header() -> None:
    print(
        f"{'backend':<9}{'policies':>10}{'seed pol/s':>12}"
        f"{'resolve p50':>13}{'p99':>9}{'lookup p50':>12}{'p99':>9}{'page p50':>10}{'p99':>9}   (µs)"
    )


def print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['backend']:<9}{r['policies']:>10,}{r['seed_policies_per_s']:>12,.0f}"
        f"{r['resolve']['p50_us']:>13.0f}{r['resolve']['p99_us']:>9.0f}"
        f"{r['revision_lookup']['p50_us']:>12.0f}{r['revision_lookup']['p99_us']:>9.0f}"
        f"{r['middle_page_100']['p50_us']:>10.0f}{r['middle_page_100']['p99_us']:>9.0f}",
        flush=True,
    )


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for backend in sorted({r["backend"] for r in rows}):
        mine = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["policies"])
        small, large = mine[0], mine[-1]
        out[backend] = {
            f"{metric}_p99_ratio": large[metric]["p99_us"] / small[metric]["p99_us"]
            for metric in ("resolve", "revision_lookup", "middle_page_100")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="1000,100000,1000000", help="comma-separated policy counts, ascending"
    )
    parser.add_argument("--lookups", type=int, default=3000, help="random lookups per measurement (>= 1000)")
    parser.add_argument("--revisions-per-policy", type=int, default=2)
    parser.add_argument(
        "--pg-url", default=os.environ.get("MINT_TEST_POSTGRES_URL"), help="also run on PostgreSQL"
    )
    parser.add_argument("--backends", default=None, help="comma-separated subset of sqlite,postgres")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the SQLite file and blobs go (temp dir)"
    )
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    backends = (
        args.backends.split(",") if args.backends else ["sqlite"] + (["postgres"] if args.pg_url else [])
    )

    print_header()
    rows: list[dict[str, Any]] = []
    for backend in backends:
        workdir = Path(tempfile.mkdtemp(prefix=f"mint-bench-{backend}-", dir=args.workdir))
        try:
            with ExitStack() as stack:
                urls = {
                    size: stack.enter_context(fresh_database(backend, args.pg_url, workdir, size))
                    for size in sizes
                }
                rows += run_backend(backend, urls, workdir, args.revisions_per_policy, args.lookups)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"rows": rows, "p99_ratio_largest_vs_smallest": ratios(rows), "goal": "ratios <= 1.5"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
