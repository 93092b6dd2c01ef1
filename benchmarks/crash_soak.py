"""Crash soak: `mint serve` SIGKILLed at random moments of a mixed workload, restarted on the same data
dir, and every write it acknowledged before the kill checked.

    python -m benchmarks.crash_soak [--cycles 50] [--seed 0] [--window 6] [--postgres URL]

One `mint serve` (a subprocess on 127.0.0.1, on a tiny random Llama) per cycle. While it runs, three
client threads work on it at once:

* a trainer (the tinker SDK): forward_backward + optim_step, then save_state or
  save_weights_for_sampler (each sampler save publishes the next revision of policy `soak`);
* a catalog client (the HTTP catalog routes `mint` uses in remote mode): alias moves and rollbacks
  of `soak@prod`, eval records, imports of a PEFT adapter into `soak-imported` (now and then through
  the `mint import` CLI itself);
* a sampler: greedy samples from `soak@prod`.

At a random moment of the cycle (seeded), the server gets SIGKILL: at a random time, or while a
catalog write (alias move, eval, import) or a save is in flight — with `--postgres` the catalog is
on PostgreSQL, so those kills land inside open transactions. The server is restarted on the same data
dir and must be ready (healthz 200) within --ready-bound (READY_S, 120 s). Then:

* nothing acknowledged is lost: every checkpoint path, imported revision (number and sha256), alias
  move (its reason in the alias's history) and eval record a client was told about is there;
* nothing is half-visible: every policy's revisions are numbered without gaps, verify against their
  blobs and have existing parents; every alias points where its last history event moved it; every
  listed checkpoint has its data and nothing else lies in the run dirs; every sampler checkpoint
  is the payload of a revision; the revisions and checkpoints new in this cycle load and sample,
  and its newest saved states load into a training client;
* no orphans after the start's sweep: nothing in the blob store's tmp, the server's ephemeral dir
  or its TMPDIR, no record temp file in the run dirs; blobs no revision references (a publish killed
  between its puts and its transaction) are counted, left to `mint catalog gc`.

Prints a line per cycle and, last, one JSON line with the figures (restart times: median and max).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import tinker
from sqlalchemy import select
from tinker import types

from mint_server.api.auth.keys import owner_id
from mint_server.catalog import Catalog, payload
from mint_server.catalog.schema import ManifestEntryRow
from mint_server.cli.catalog_client import HttpClient
from tests.lifecycle.helpers import MINT, PROMPT, ServeProcess, clean_env
from tests.service.live import LR, batch

POLICY, IMPORTED, ALIAS, METRIC = "soak", "soak-imported", "prod", "soak_score"
READY_S = 120.0  # the stated bound (--ready-bound): a restarted server answers healthz within this
CALL_S = 60.0  # the longest one client call may take while the server is up
CHECK_LOADS = 2  # per cycle and kind: the newest saved states loaded, sampler checkpoints sampled
ADAM = types.AdamParams(learning_rate=LR)
ONE_TOKEN = types.SamplingParams(max_tokens=1, temperature=0.0, stop=[])
KIND_OF_TYPE = {"training": "weights", "sampler": "sampler_weights"}
MOMENTS = ("any", "catalog write", "save")  # when in the cycle the kill lands


class Stopped(Exception):
    """The cycle's kill came: the thread stops (what it was waiting for may never answer)."""


@dataclass
class Acks:
    """Writes the server acknowledged (a client got its answer), by kind; thread-safe."""

    checkpoints: list[str] = field(default_factory=list)  # tinker paths
    imports: list[tuple[int, str]] = field(default_factory=list)  # (revision number, sha256) of IMPORTED
    alias_moves: list[str] = field(default_factory=list)  # reasons, each unique
    evals: list[tuple[str, str, float]] = field(default_factory=list)  # (ref, dataset, value)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, item: Any) -> None:
        with self.lock:
            getattr(self, kind).append(item)

    def count(self) -> int:
        return len(self.checkpoints) + len(self.imports) + len(self.alias_moves) + len(self.evals)


@dataclass
class Figures:
    cycles: int = 0
    restart_s: list[float] = field(default_factory=list)
    acked: Counter[str] = field(default_factory=Counter)  # acknowledged writes checked, by kind
    lost: int = 0
    half_visible: int = 0
    orphans: int = 0
    moments: Counter[str] = field(default_factory=Counter)
    in_flight_at_kill: Counter[str] = field(default_factory=Counter)
    samples: int = 0
    problems: list[str] = field(default_factory=list)
    ready_bound_s: float = READY_S
    unreferenced_blobs: int = 0  # at the last check: left to `mint catalog gc`, not a failure

    def summary(self) -> dict[str, Any]:
        return {
            "cycles": self.cycles,
            "acknowledged_writes_checked": sum(self.acked.values()),
            "by_kind": dict(self.acked),
            "lost": self.lost,
            "half_visible": self.half_visible,
            "orphans": self.orphans,
            "unreferenced_blobs_left_to_gc": self.unreferenced_blobs,
            "restart_s_median": round(statistics.median(self.restart_s), 2) if self.restart_s else None,
            "restart_s_max": round(max(self.restart_s), 2) if self.restart_s else None,
            "ready_bound_s": self.ready_bound_s,
            "kill_moments": dict(self.moments),
            "in_flight_at_kill": dict(self.in_flight_at_kill),
            "samples_during_workload": self.samples,
            "problems": self.problems[:20],
        }


def all_pages(fetch: Callable[..., Any]) -> list[Any]:
    items, cursor = [], None
    while True:
        page = fetch(cursor=cursor)
        items += page.items
        if (cursor := page.next_cursor) is None:
            return items


class Soak:
    def __init__(
        self,
        tiny_dir: Path,
        root: Path,
        *,
        seed: int = 0,
        window_s: float = 6.0,
        db_url: str | None = None,
        ready_s: float = READY_S,
        log: Callable[[str], None] = print,
    ) -> None:
        self.ready_s = ready_s
        self.tiny_dir, self.root, self.db_url, self.log = tiny_dir, root, db_url, log
        self.rng = random.Random(seed)
        self.window_s = window_s
        self.data = root / "data"
        self.tmp = root / "tmp"  # the server's TMPDIR: what a killed server leaves there is checked
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.figures = Figures()
        self.starts = 0
        self.checked_revisions: set[tuple[str, int]] = set()
        self.checked_checkpoints: set[str] = set()
        self.server = self._start()
        self.key = (self.data / "api_key").read_text().strip()  # made by the first start, then reused
        self.owner = owner_id(self.key)
        self.source = root / "import-source"  # the PEFT adapter every import publishes
        self._setup()

    # -- the server ----------------------------------------------------------------------------
    def _start(self) -> ServeProcess:
        self.starts += 1
        # Eager decode, as the test suite runs: a compile in the background of every start would
        # spend the CPU the workload and the next restart need.
        extra = ("--compile", "off", *(("--db-url", self.db_url) if self.db_url else ()))
        t0 = time.monotonic()
        server = _Serve(
            self.tiny_dir,
            self.data,
            self.root / f"serve-{self.starts}.log",
            env=clean_env(TMPDIR=str(self.tmp)),
            extra=extra,
        )
        took = time.monotonic() - t0
        if self.starts > 1:
            self.figures.restart_s.append(took)
            if took > self.ready_s:
                self.figures.problems.append(
                    f"start {self.starts}: ready after {took:.1f}s > {self.ready_s}s"
                )
        return server

    def close(self) -> None:
        self.server.kill(signal.SIGKILL)

    def _catalog(self) -> Catalog:
        """The server's catalog opened by a second process, as `mint … --data-dir` does."""
        return Catalog.open(self.db_url, data_dir=self.data)

    def _setup(self) -> None:
        """Revision 1 of POLICY with alias prod at it, and a PEFT adapter to import."""
        sc = tinker.ServiceClient(base_url=self.server.url, api_key=self.key)
        tc = self._training_client(sc)
        tc.forward_backward(batch(), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        tc.save_weights_for_sampler("setup").result()
        with closing(HttpClient(self.server.url, self.key)) as catalog:
            catalog.set_alias(POLICY, ALIAS, 1, reason="setup")
            catalog.export(f"{POLICY}@1", self.source)
        sc.close("success").result()

    def _training_client(self, sc: tinker.ServiceClient, *, block: bool = True) -> Any:
        rest = tinker.RestClient(base_url=self.server.url, api_key=self.key)
        base = rest.get_server_capabilities().result(timeout=CALL_S).supported_models[0].model_name
        made = sc.create_lora_training_client(base_model=base, rank=4, user_metadata={"policy": POLICY})
        return made.result() if block else made

    # -- one cycle -----------------------------------------------------------------------------
    def cycle(self, n: int) -> None:
        acks = Acks()
        stop = threading.Event()
        in_flight: dict[str, int] = Counter()  # what each thread is waiting for the server to do
        lock = threading.Lock()
        rng = random.Random(self.rng.random())
        moment = rng.choice(MOMENTS)
        kill_after = rng.uniform(0.5, self.window_s)
        server = self.server

        @contextmanager
        def doing(what: str) -> Iterator[None]:
            if stop.is_set():
                raise Stopped
            with lock:
                in_flight[what] += 1
            try:
                yield
            finally:
                with lock:
                    in_flight[what] -= 1

        def wait(future: Any) -> Any:
            """An SDK future's result, given up on when the kill comes (the SDK would retry for long)."""
            f = future.future() if hasattr(future, "future") else future
            deadline = time.monotonic() + CALL_S
            while not cf.wait([f], timeout=0.05).done:
                if stop.is_set():
                    raise Stopped
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer in {CALL_S}s")
            return f.result()

        def trainer() -> None:
            sc = tinker.ServiceClient(base_url=server.url, api_key=self.key)
            try:
                with doing("create model"):
                    tc = wait(self._training_client(sc, block=False))
                i = 0
                while not stop.is_set():
                    with doing("train step"):
                        fb = tc.forward_backward(batch(), "cross_entropy")
                        opt = tc.optim_step(ADAM)
                        wait(fb), wait(opt)
                    if rng.random() < 0.5:
                        with doing("save"):
                            save = (
                                tc.save_state(f"c{n}-w{i}")
                                if rng.random() < 0.4
                                else tc.save_weights_for_sampler(f"c{n}-s{i}")
                            )
                            acks.add("checkpoints", wait(save).path)
                    i += 1
            finally:
                sc.close("interrupted").future().cancel()

        def catalog_writer() -> None:
            with closing(HttpClient(server.url, self.key, timeout=CALL_S)) as catalog:
                i = 0
                while not stop.is_set():
                    op = rng.choices(["alias", "rollback", "eval", "import", "mint import"], [4, 1, 3, 2, 1])[
                        0
                    ]
                    reason = f"c{n}-{i}"
                    with doing("catalog write"):
                        if op == "alias":
                            latest = catalog.list_revisions(POLICY, limit=1).items[0].number
                            catalog.set_alias(POLICY, ALIAS, rng.randint(1, latest), reason=reason)
                            acks.add("alias_moves", reason)
                        elif op == "rollback":
                            try:
                                catalog.rollback_alias(POLICY, ALIAS, reason=reason)
                                acks.add("alias_moves", reason)
                            except Exception as e:  # nothing to roll back to is a refusal, not a failure
                                if "nothing to roll back" not in str(e) and "no earlier" not in str(e):
                                    raise
                        elif op == "eval":
                            latest = catalog.list_revisions(POLICY, limit=1).items[0].number
                            value = round(rng.random(), 6)
                            catalog.record_eval(f"{POLICY}@{latest}", METRIC, value, dataset=reason)
                            acks.add("evals", (f"{POLICY}@{latest}", reason, value))
                        elif op == "import":
                            revision = catalog.import_peft(self.source, IMPORTED, note=reason)
                            acks.add("imports", (revision.number, revision.sha256))
                        else:
                            self._mint_import(server.url, reason, stop, acks)
                    i += 1

        def sampler() -> None:
            sc = tinker.ServiceClient(base_url=server.url, api_key=self.key)
            try:
                with doing("create sampler"):
                    client = wait(sc.create_sampling_client(model_path=f"tinker://{POLICY}@{ALIAS}"))
                while not stop.is_set():
                    with doing("sample"):
                        wait(client.sample(PROMPT, 1, ONE_TOKEN))
                    with lock:
                        self.figures.samples += 1
            finally:
                sc.close("interrupted").future().cancel()

        errors: list[str] = []

        def guarded(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except Stopped:
                    pass
                except Exception as e:  # noqa: BLE001 - after the kill every call fails; before it, none may
                    if not stop.is_set():
                        errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")

            return run

        threads = [
            threading.Thread(target=guarded(f), daemon=True, name=f.__name__)
            for f in (trainer, catalog_writer, sampler)
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        # The kill: at `kill_after`, or (for the targeted moments) the first time after it that such
        # a request is in flight; a cycle is bounded either way.
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= kill_after:
                with lock:
                    busy = moment == "any" or in_flight[moment] > 0
                if busy or elapsed >= kill_after + 2 * self.window_s:
                    break
            if errors:
                break
            time.sleep(0.005)  # a poll interval, not a wait for anything
        with lock:
            busy_now = sorted(k for k, v in in_flight.items() if v > 0)
        stop.set()  # first: what fails from here on is the kill's doing
        server.kill(signal.SIGKILL)
        killed_at = time.monotonic() - t0
        for t in threads:  # a thread still waiting on the dead server is left behind (a daemon)
            t.join(timeout=5)
        with acks.lock:
            acks_now = Acks(
                list(acks.checkpoints), list(acks.imports), list(acks.alias_moves), list(acks.evals)
            )
        self.figures.moments[moment] += 1
        for what in busy_now:
            self.figures.in_flight_at_kill[what] += 1
        for e in errors:
            self.figures.problems.append(f"cycle {n}: before the kill: {e}")

        self.server = self._start()
        lost, half = self.check(n, acks_now)
        self.figures.cycles += 1
        self.log(
            f"cycle {n}: killed at {killed_at:.1f}s ({moment}; in flight: {', '.join(busy_now) or '-'}); "
            f"acknowledged {acks_now.count()}; ready again in {self.figures.restart_s[-1]:.1f}s; "
            f"lost {lost}, half-visible {half}, orphans {self.figures.orphans}, unreferenced blobs "
            f"{self.figures.unreferenced_blobs}"
        )

    def _mint_import(self, url: str, reason: str, stop: threading.Event, acks: Acks) -> None:
        """`mint import` as a user runs it, against the server."""
        import subprocess

        proc = subprocess.Popen(
            [MINT, "import", str(self.source), "--policy", IMPORTED, "--note", reason, "--server", url,
             "--api-key", self.key, "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())  # fmt: skip
        try:
            out, err = proc.communicate(timeout=CALL_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            if stop.is_set():
                raise Stopped
            raise RuntimeError(f"mint import -> {proc.returncode}: {err.strip()}")
        revision = json.loads(out)
        acks.add("imports", (revision["number"], revision["sha256"]))

    # -- after the restart ---------------------------------------------------------------------
    def problem(self, kind: str, text: str) -> None:
        if kind == "lost":
            self.figures.lost += 1
        elif kind == "half":
            self.figures.half_visible += 1
        else:
            self.figures.orphans += 1
        self.figures.problems.append(f"start {self.starts}: {kind}: {text}")

    def check(self, n: int, acks: Acks) -> tuple[int, int]:
        before = (self.figures.lost, self.figures.half_visible)
        self.figures.acked.update(
            checkpoints=len(acks.checkpoints),
            imports=len(acks.imports),
            alias_moves=len(acks.alias_moves),
            evals=len(acks.evals),
        )
        checkpoints = self._check_runs()
        revisions = self._check_catalog(acks)
        paths = {c.tinker_path: c for cs in checkpoints.values() for c in cs}
        for path in acks.checkpoints:
            if path not in paths:
                self.problem("lost", f"acknowledged checkpoint {path}")
        self._check_sampler_payloads(checkpoints, revisions)
        self._check_loads(paths, revisions)
        self._check_orphans()
        return self.figures.lost - before[0], self.figures.half_visible - before[1]

    def _check_runs(self) -> dict[str, list[types.Checkpoint]]:
        """Every listed checkpoint has its data and its record, and nothing else is in the run dirs."""
        rest = tinker.RestClient(base_url=self.server.url, api_key=self.key)
        runs = [r.training_run_id for r in all_pages_runs(rest)]
        out = {}
        for rid in runs:
            listed = rest.list_checkpoints(rid).result().checkpoints
            out[rid] = listed
            run_dir = self.data / "runs" / rid.replace(":", "_")
            for kind in KIND_OF_TYPE.values():
                names = {
                    c.tinker_path.rsplit("/", 1)[1] for c in listed if KIND_OF_TYPE[c.checkpoint_type] == kind
                }
                on_disk = {p.name for p in (run_dir / kind).glob("*")}
                records = {p.stem for p in (run_dir / "checkpoints" / kind).glob("*")}
                if on_disk != names or records != names:
                    self.problem(
                        "half",
                        f"{rid}/{kind}: listed {sorted(names)}, data {sorted(on_disk)}, "
                        f"records {sorted(records)}",
                    )
                for name in names & on_disk:
                    if not any((run_dir / kind / name).iterdir()):
                        self.problem("half", f"{rid}/{kind}/{name} is empty")
        return out

    def _check_catalog(self, acks: Acks) -> dict[str, list[Any]]:
        revisions: dict[str, list[Any]] = {}
        with self._catalog() as catalog:
            for policy in all_pages(partial(catalog.list_policies, self.owner)):
                name = policy.name
                revs = sorted(
                    all_pages(partial(catalog.list_revisions, self.owner, name)), key=lambda r: r.number
                )
                revisions[name] = revs
                if [r.number for r in revs] != list(range(1, len(revs) + 1)):
                    self.problem("half", f"{name}: revisions {[r.number for r in revs]} have gaps")
                for rev in revs:
                    if (name, rev.number) in self.checked_revisions:
                        continue
                    try:
                        catalog.verify(rev)
                        if (
                            rev.parent is not None
                            and catalog.resolve(self.owner, rev.parent).id != rev.parent_id
                        ):
                            raise AssertionError(f"parent {rev.parent} is another revision")
                    except Exception as e:  # noqa: BLE001 - reported, with the rest
                        self.problem("half", f"{rev.ref} does not verify: {e}")
                for alias in all_pages(partial(catalog.list_aliases, self.owner, name)):
                    latest = catalog.alias_history(self.owner, name, alias.name, limit=1).items[0]
                    if latest.to_revision != alias.revision or not 1 <= alias.revision <= len(revs):
                        self.problem(
                            "half",
                            f"{name}@{alias.name} at {alias.revision}, history says {latest.to_revision}",
                        )
            reasons = {e.reason for e in all_pages(partial(catalog.alias_history, self.owner, POLICY, ALIAS))}
            for reason in acks.alias_moves:
                if reason not in reasons:
                    self.problem("lost", f"acknowledged alias move {reason!r}")
            imported = {(r.number, r.sha256) for r in revisions.get(IMPORTED, [])}
            for number, sha in acks.imports:
                if (number, sha) not in imported:
                    self.problem("lost", f"acknowledged import {IMPORTED}@{number}")
            by_ref: dict[str, set[tuple[str | None, float]]] = {}
            for ref, dataset, value in acks.evals:
                if ref not in by_ref:
                    by_ref[ref] = {
                        (e.dataset, e.value)
                        for e in all_pages(partial(catalog.list_evals, self.owner, ref, metric=METRIC))
                    }
                if (dataset, value) not in by_ref[ref]:
                    self.problem("lost", f"acknowledged eval {METRIC}={value} of {ref} ({dataset})")
        return revisions

    def _check_sampler_payloads(
        self, checkpoints: dict[str, list[types.Checkpoint]], revisions: dict[str, list[Any]]
    ) -> None:
        """A sampler checkpoint exists only with its revision: its files are a revision of its run."""
        published = {(r.training_run, r.sha256) for revs in revisions.values() for r in revs}
        for rid, listed in checkpoints.items():
            for c in listed:
                if (
                    KIND_OF_TYPE[c.checkpoint_type] != "sampler_weights"
                    or c.tinker_path in self.checked_checkpoints
                ):
                    continue
                data = (
                    self.data
                    / "runs"
                    / rid.replace(":", "_")
                    / "sampler_weights"
                    / c.tinker_path.rsplit("/", 1)[1]
                )
                try:
                    sha = payload.manifest_sha256(payload.hash_dir(payload.scan_peft_dir(data).files))
                except Exception as e:  # noqa: BLE001
                    self.problem("half", f"{c.tinker_path} unreadable: {e}")
                    continue
                if (rid, sha) not in published:
                    self.problem("half", f"{c.tinker_path} has no revision")

    def _check_loads(self, paths: dict[str, types.Checkpoint], revisions: dict[str, list[Any]]) -> None:
        """What is new since the last check loads: revisions and sampler checkpoints sample (the
        newest CHECK_LOADS of each), saved states load into a training client."""
        new = [p for p in paths if p not in self.checked_checkpoints]
        weights = [p for p in new if KIND_OF_TYPE[paths[p].checkpoint_type] == "weights"]
        sampler = [p for p in new if KIND_OF_TYPE[paths[p].checkpoint_type] == "sampler_weights"]
        new_revs = [
            r
            for revs in revisions.values()
            for r in revs
            if (r.policy, r.number) not in self.checked_revisions
        ]
        model_paths = sampler[-CHECK_LOADS:] + [f"tinker://{r.ref}" for r in new_revs[-2 * CHECK_LOADS :]]
        sc = tinker.ServiceClient(base_url=self.server.url, api_key=self.key)
        try:
            for path in weights[-CHECK_LOADS:]:
                try:
                    sc.create_training_client_from_state(path).result(timeout=CALL_S)
                except Exception as e:  # noqa: BLE001
                    self.problem("half", f"saved state {path} does not load: {e}")
            for path in model_paths:
                try:
                    client = sc.create_sampling_client(model_path=path).result(timeout=CALL_S)
                    seq = client.sample(PROMPT, 1, ONE_TOKEN).result(timeout=CALL_S)
                    assert len(seq.sequences[0].tokens) == 1
                except Exception as e:  # noqa: BLE001
                    self.problem("half", f"{path} does not sample: {e}")
        finally:
            sc.close("success").future().cancel()
        self.checked_checkpoints.update(new)
        self.checked_revisions.update((r.policy, r.number) for r in new_revs)

    def _check_orphans(self) -> None:
        """What a killed server was writing is gone once the next one has started."""
        leftovers = [
            p
            for d in (self.data / "blobs" / "tmp", self.data / "ephemeral", self.tmp)
            if d.exists()
            for p in d.iterdir()
        ]
        for p in leftovers:
            self.problem("orphan", f"{p} left behind")
        with self._catalog() as catalog:
            with catalog.engine.connect() as conn:
                referenced = set(conn.scalars(select(ManifestEntryRow.blob_sha256).distinct()))
            stored = {b.sha256 for b in catalog.blobs.iter()}
        # Whole blobs of a publish killed between its puts and its transaction: not swept at start
        # (a publisher in another process may be about to commit them); `mint catalog gc` takes them
        # after its grace period, and a retried publish of the same content reuses them. Counted.
        self.figures.unreferenced_blobs = len(stored - referenced)


class _Serve(ServeProcess):
    """`mint serve` as the lifecycle tests start it, given longer to come up on a busy machine: a
    start slower than READY_S is reported, not fatal."""

    def _wait_healthy(self, timeout: float = 10 * READY_S) -> None:
        super()._wait_healthy(timeout)


def all_pages_runs(rest: Any) -> list[types.TrainingRun]:
    runs, offset = [], 0
    while True:
        page = rest.list_training_runs(limit=100, offset=offset).result()
        runs += page.training_runs
        if len(page.training_runs) < 100:
            return runs
        offset += 100


def run(
    tiny_dir: Path,
    root: Path,
    cycles: int,
    *,
    seed: int = 0,
    window_s: float = 6.0,
    db_url: str | None = None,
    ready_s: float = READY_S,
    log: Callable[[str], None] = print,
) -> Figures:
    soak = Soak(tiny_dir, root, seed=seed, window_s=window_s, db_url=db_url, ready_s=ready_s, log=log)
    soak.figures.ready_bound_s = ready_s
    try:
        for n in range(1, cycles + 1):
            soak.cycle(n)
    finally:
        soak.close()
    return soak.figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=float, default=6.0, help="kills land 0.5..WINDOW s into a cycle")
    parser.add_argument(
        "--postgres", metavar="URL", help="catalog on PostgreSQL (a fresh schema of this database)"
    )
    parser.add_argument("--ready-bound", type=float, default=READY_S, help="seconds a restart may take")
    parser.add_argument("--keep", action="store_true", help="keep the data dir (its path is printed)")
    args = parser.parse_args()

    from tests.tiny import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="mint-crash-soak-"))
    try:
        tiny = make_tiny_checkpoint(root / "tiny", family="llama", tie=True)
        with _pg_schema(args.postgres) as db_url:
            figures = run(
                tiny,
                root / "soak",
                args.cycles,
                seed=args.seed,
                window_s=args.window,
                db_url=db_url,
                ready_s=args.ready_bound,
            )
    finally:
        if args.keep:
            print(f"data kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    summary = figures.summary()
    print(json.dumps({"catalog": "postgresql" if args.postgres else "sqlite", "seed": args.seed, **summary}))
    sys.exit(0 if not (figures.lost or figures.half_visible or figures.orphans or figures.problems) else 1)


@contextmanager
def _pg_schema(url: str | None) -> Iterator[str | None]:
    if url is None:
        yield None
        return
    os.environ["MINT_TEST_POSTGRES_URL"] = url
    import tests.pg

    tests.pg.PG_URL = url
    with tests.pg.fresh_pg_schema() as schema_url:
        yield schema_url


if __name__ == "__main__":
    main()
