"""The kill -9 matrix: `mint serve` is SIGKILLed while several operations of one kind are in flight
(optim_step, save_state, save_weights_for_sampler, alias moves, exports, catalog imports). After a
restart on the same data dir:

* the runs and the catalog are consistent and nothing is half-visible: every listed checkpoint has
  its data and nothing else lies in the run dirs (no staging, trash or record-less data); every
  sampler checkpoint is the payload of a revision of its run; every policy's revisions are numbered
  without gaps, verify against their blobs, and have existing parents; every alias points at an
  existing revision, the one its last history event moved it to;
* whatever the clients were told was done is there;
* every saved state resumes: a training client made from each `weights` checkpoint trains, and each
  sampler checkpoint and revision samples.

The cases share one data dir and hand the restarted server on to the next case (a case that finds
no live server starts one), so the matrix pays for one server start per case, not two; the
consistency checks cover the whole data dir, the resume checks what this case made.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from mint_server.api.auth.keys import owner_id
from mint_server.api.state.runs import CheckpointRecord, RunRecord, RunStore
from mint_server.api.tinker.paths import CheckpointRef
from mint_server.catalog import Catalog, payload
from mint_server.catalog.records import Revision
from mint_server.cli.catalog_client import HttpClient
from mint_server.fsutil import TRASH_PREFIX
from tests.lifecycle.helpers import PROMPT, ServeProcess, clean_env
from tests.service.live import LR, batch, train

IN_FLIGHT = 4  # operations fired at once: few, so the matrix stays cheap on a 2-core CI machine
DEADLINE = 60.0  # seconds any awaited condition may take before the test fails (or kills anyway)
ADAM = types.AdamParams(learning_rate=LR)
ONE_TOKEN = types.SamplingParams(max_tokens=1, temperature=0.0, stop=[])
KIND_OF_TYPE = {"training": "weights", "sampler": "sampler_weights"}


class Lineage:
    """One data dir across the matrix, served by one `mint serve` at a time."""

    def __init__(self, tiny_dir: Path, root: Path) -> None:
        self.tiny_dir, self.root = tiny_dir, root
        self.data = root / "data"
        self.tmp = root / "tmp"  # the server's TMPDIR: what a kill leaves there stays out of /tmp
        self.tmp.mkdir()
        self.starts = 0
        self.server = self._start()
        self.key = (self.data / "api_key").read_text().strip()  # made by the first start, then reused
        self.owner = owner_id(self.key)

    def _start(self) -> ServeProcess:
        self.starts += 1
        log = self.root / f"serve-{self.starts}.log"
        return ServeProcess(self.tiny_dir, self.data, log, env=clean_env(TMPDIR=str(self.tmp)))

    def live_server(self) -> ServeProcess:
        if self.server.proc.poll() is not None:  # an earlier case failed after its kill
            self.server = self._start()
        return self.server

    def restart(self) -> ServeProcess:
        self.server.kill(signal.SIGKILL)
        self.server = self._start()
        return self.server


@pytest.fixture(scope="module")
def lineage(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lineage]:
    lin = Lineage(tiny_dir, tmp_path_factory.mktemp("kill-matrix"))
    try:
        yield lin
    finally:
        lin.server.kill(signal.SIGTERM)


@dataclass
class Case:
    """What one case made before its kill, and what the clients were told was done during it."""

    op: str
    policy: str
    sc: tinker.ServiceClient
    catalog: HttpClient
    tc: Any  # tinker.TrainingClient of `policy`
    weights: str  # a saved state, acknowledged before the kill
    told: list[Any] = field(default_factory=list)
    futures: list[cf.Future[Any]] = field(default_factory=list)  # what was in flight when killed

    @property
    def policies(self) -> tuple[str, str]:
        return self.policy, f"{self.policy}-imported"


def prepare(lineage: Lineage, op: str) -> Case:
    """A training client publishing to its own policy: trained, its state saved, two sampler saves
    (revisions 1 and 2), alias prod at 1."""
    server = lineage.live_server()
    sc = tinker.ServiceClient(base_url=server.url, api_key=lineage.key)
    rest = tinker.RestClient(base_url=server.url, api_key=lineage.key)
    base_model = rest.get_server_capabilities().result().supported_models[0].model_name
    policy = f"km-{op.replace('_', '-')}"
    tc = sc.create_lora_training_client(
        base_model=base_model, rank=4, user_metadata={"policy": policy}
    ).result()
    train(tc, 1)
    weights = tc.save_state("w0").result().path
    tc.save_weights_for_sampler("s1").result()
    train(tc, 1)
    tc.save_weights_for_sampler("s2").result()
    catalog = HttpClient(server.url, lineage.key)
    catalog.set_alias(policy, "prod", 1)
    return Case(op, policy, sc, catalog, tc, weights)


def kill_when(
    server: ServeProcess, futures: list[cf.Future[Any]], marker: Callable[[], bool] | None = None
) -> None:
    """SIGKILL the server while the operations are in flight: once one has finished (a client was
    told) and `marker`, if given, shows another under way on disk; or once all have finished (a
    kill anywhere must be safe too)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        done = sum(f.done() for f in futures)
        if (done and (marker is None or marker())) or done == len(futures):
            break
        assert time.monotonic() < deadline, f"{done} of {len(futures)} operations finished in {DEADLINE}s"
        time.sleep(0.002)  # a poll interval, not a wait for anything
    server.kill(signal.SIGKILL)


def settle(case: Case) -> None:
    """After the kill: note what the client was told was done; give up on the rest."""
    for f in case.futures:
        f.cancel()
    done, _ = cf.wait(case.futures, timeout=DEADLINE)
    case.told = [f.result() for f in done if not f.cancelled() and f.exception() is None]
    closing = case.sc.close("interrupted")  # stops heartbeats; the finish call itself can never arrive
    closing.future().cancel()
    case.catalog.close()


def sdk_futures(api_futures: list[Any]) -> list[cf.Future[Any]]:
    return [f.future() for f in api_futures]


def in_threads(calls: list[Callable[[], Any]]) -> tuple[cf.ThreadPoolExecutor, list[cf.Future[Any]]]:
    pool = cf.ThreadPoolExecutor(max_workers=IN_FLIGHT)
    return pool, [pool.submit(call) for call in calls]


def run_dirs(data: Path) -> list[Path]:
    return [p for p in (data / "runs").iterdir() if p.is_dir()]


# --- the operations, each fired IN_FLIGHT-ish times and killed mid-way ---------------------------
def kill_during_optim_step(case: Case, server: ServeProcess, lineage: Lineage) -> None:
    steps = []
    for _ in range(IN_FLIGHT):
        case.tc.forward_backward(batch(), "cross_entropy")
        steps.append(case.tc.optim_step(ADAM))
    case.futures = sdk_futures(steps)
    kill_when(server, case.futures)


def _staged(data: Path, kind: str) -> Callable[[], bool]:
    """A save under way: a staging dir, or data moved into place before its record is written."""

    def marker() -> bool:
        for run in run_dirs(data):
            for entry in (run / kind).glob("*"):
                if (
                    entry.name.startswith(".")
                    or not (run / "checkpoints" / kind / f"{entry.name}.json").exists()
                ):
                    return True
        return False

    return marker


def kill_during_save_state(case: Case, server: ServeProcess, lineage: Lineage) -> None:
    saves = []
    for i in range(IN_FLIGHT):
        case.tc.forward_backward(batch(), "cross_entropy")
        case.tc.optim_step(ADAM)
        saves.append(case.tc.save_state(f"st{i}"))
        saves.append(case.tc.save_state("w0", overwrite=True))  # replaces acknowledged data in place
    case.futures = sdk_futures(saves)
    kill_when(server, case.futures, _staged(lineage.data, "weights"))


def kill_during_save_weights_for_sampler(case: Case, server: ServeProcess, lineage: Lineage) -> None:
    saves = []
    for i in range(IN_FLIGHT):
        case.tc.forward_backward(batch(), "cross_entropy")
        case.tc.optim_step(ADAM)
        saves.append(case.tc.save_weights_for_sampler(f"sw{i}"))
    case.futures = sdk_futures(saves)
    kill_when(server, case.futures, _staged(lineage.data, "sampler_weights"))


def kill_during_alias_move(case: Case, server: ServeProcess, lineage: Lineage) -> None:
    def move(i: int) -> Any:
        with closing(HttpClient(server.url, lineage.key)) as client:
            reason = f"move {i}"
            if i % 3 == 2:
                return reason, client.rollback_alias(case.policy, "prod", reason=reason)
            return reason, client.set_alias(case.policy, "prod", 1 + i % 2, reason=reason)

    pool, case.futures = in_threads([lambda i=i: move(i) for i in range(3 * IN_FLIGHT)])
    kill_when(server, case.futures)
    pool.shutdown(wait=False)


def kill_during_export(case: Case, server: ServeProcess, lineage: Lineage) -> None:
    exports = lineage.root / f"exports-{case.op}"

    def export_revision(i: int) -> tuple[Revision, Path]:
        with closing(HttpClient(server.url, lineage.key)) as client:
            dest = exports / f"rev-{i}"
            return client.export(f"{case.policy}@{1 + i % 2}", dest), dest

    def download_archive(tinker_path: str) -> bytes:
        run_id, kind_name = tinker_path.removeprefix("tinker://").split("/", 1)
        url = f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/{kind_name}/archive"
        response = httpx.get(url, headers={"X-API-Key": lineage.key}, follow_redirects=True, timeout=DEADLINE)
        response.raise_for_status()
        return response.content

    # Revision exports, and archives of a training state (exported to PEFT by the engine on the
    # way) and of sampler weights; twice as many as there are threads, so some wait their turn.
    sampler = f"{case.weights.rsplit('/weights/', 1)[0]}/sampler_weights/s1"
    calls: list[Callable[[], Any]] = []
    for i in range(IN_FLIGHT // 2):
        calls += [lambda i=i: export_revision(i), lambda: download_archive(case.weights)]
        calls += [lambda i=i: export_revision(i + IN_FLIGHT), lambda: download_archive(sampler)]
    pool, case.futures = in_threads(calls)
    kill_when(server, case.futures)
    pool.shutdown(wait=False)


def kill_during_catalog_import(case: Case, server: ServeProcess, lineage: Lineage) -> None:
    source = lineage.root / f"import-source-{case.op}"
    case.catalog.export(f"{case.policy}@2", source)
    target = case.policies[1]

    def upload(i: int) -> Revision:
        with closing(HttpClient(server.url, lineage.key)) as client:
            return client.import_peft(source, target, note=f"import {i}")

    pool, case.futures = in_threads([lambda i=i: upload(i) for i in range(2 * IN_FLIGHT)])
    kill_when(server, case.futures)
    pool.shutdown(wait=False)


KILLERS: dict[str, Callable[[Case, ServeProcess, Lineage], None]] = {
    "optim_step": kill_during_optim_step,
    "save_state": kill_during_save_state,
    "save_weights_for_sampler": kill_during_save_weights_for_sampler,
    "alias_move": kill_during_alias_move,
    "export": kill_during_export,
    "catalog_import": kill_during_catalog_import,
}


# --- after the restart ---------------------------------------------------------------------------
@dataclass
class Listed:
    runs: dict[str, types.TrainingRun]
    checkpoints: dict[str, list[types.Checkpoint]]  # run id -> its checkpoints
    revisions: dict[str, list[Revision]]  # policy -> its revisions, by number


def all_pages(fetch: Callable[..., Any]) -> list[Any]:
    """Every item of a paged catalog listing; `fetch` takes the cursor."""
    items, cursor = [], None
    while True:
        page = fetch(cursor=cursor)
        items += page.items
        if (cursor := page.next_cursor) is None:
            return items


def check_runs(
    lineage: Lineage, rest: Any
) -> tuple[dict[str, types.TrainingRun], dict[str, list[types.Checkpoint]]]:
    """Runs list exactly what is on disk, and every checkpoint is complete and alone in its dir."""
    runs = {r.training_run_id: r for r in rest.list_training_runs(limit=1000).result().training_runs}
    on_disk = {d for d in run_dirs(lineage.data) if (d / "run.json").exists()}
    assert {lineage.data / "runs" / rid.replace(":", "_") for rid in runs} == on_disk
    checkpoints = {}
    for rid, run in runs.items():
        listed = rest.list_checkpoints(rid).result().checkpoints
        checkpoints[rid] = listed
        run_dir = lineage.data / "runs" / rid.replace(":", "_")
        for kind in KIND_OF_TYPE.values():
            names = {
                c.tinker_path.rsplit("/", 1)[1] for c in listed if KIND_OF_TYPE[c.checkpoint_type] == kind
            }
            # No staging or trash dirs, no data without its record, no record without its data.
            assert {p.name for p in (run_dir / kind).glob("*")} == names, f"{rid} {kind}"
            assert {p.stem for p in (run_dir / "checkpoints" / kind).glob("*")} == names, (
                f"{rid} {kind} records"
            )
            for name in names:
                assert any((run_dir / kind / name).iterdir()), f"{rid}/{kind}/{name} is empty"
        assert run.last_checkpoint is None or run.last_checkpoint.tinker_path in {
            c.tinker_path for c in listed
        }
    return runs, checkpoints


def check_catalog(lineage: Lineage) -> dict[str, list[Revision]]:
    """Revisions numbered without gaps, complete, with existing parents; aliases where history says."""
    revisions: dict[str, list[Revision]] = {}
    with Catalog.open(data_dir=lineage.data) as catalog:  # a second process on the server's database
        owner = lineage.owner
        for policy in all_pages(partial(catalog.list_policies, owner)):
            name = policy.name
            revs = sorted(all_pages(partial(catalog.list_revisions, owner, name)), key=lambda r: r.number)
            assert [r.number for r in revs] == list(range(1, len(revs) + 1)), name
            for rev in revs:
                catalog.verify(rev)  # every file present and hashing to its recorded sha256
                if rev.parent is not None:
                    assert catalog.resolve(owner, rev.parent).id == rev.parent_id
            for alias in all_pages(partial(catalog.list_aliases, owner, name)):
                assert 1 <= alias.revision <= len(revs)
                assert catalog.resolve(owner, f"{name}@{alias.name}").number == alias.revision
                latest = catalog.alias_history(owner, name, alias.name, limit=1).items[0]
                assert latest.to_revision == alias.revision, f"{name}@{alias.name}"
            revisions[name] = revs
    return revisions


def check_consistent(lineage: Lineage) -> Listed:
    # Uploads, exports and snapshots of the killed server died with it: its scratch space is in the
    # data dir, emptied at startup, and nothing was left in its TMPDIR for good.
    assert not any((lineage.data / "ephemeral").iterdir())
    assert not any(lineage.tmp.iterdir())
    runs, checkpoints = check_runs(
        lineage, tinker.RestClient(base_url=lineage.server.url, api_key=lineage.key)
    )
    revisions = check_catalog(lineage)
    # A sampler checkpoint exists only with its revision: its files are a revision of its run.
    published = {(r.training_run, r.sha256) for revs in revisions.values() for r in revs}
    for rid, listed in checkpoints.items():
        for c in listed:
            if KIND_OF_TYPE[c.checkpoint_type] == "sampler_weights":
                data = (
                    lineage.data
                    / "runs"
                    / rid.replace(":", "_")
                    / "sampler_weights"
                    / c.tinker_path.rsplit("/", 1)[1]
                )
                sha = payload.manifest_sha256(payload.hash_dir(payload.scan_peft_dir(data).files))
                assert (rid, sha) in published, f"{c.tinker_path} has no revision"
    return Listed(runs, checkpoints, revisions)


def check_told(case: Case, lineage: Lineage, listed: Listed) -> None:
    """Whatever a client was told was done survived the kill."""
    paths = {c.tinker_path for cs in listed.checkpoints.values() for c in cs}
    assert case.weights in paths  # acknowledged before the kill (and overwritten in flight by save_state)
    if case.op in ("save_state", "save_weights_for_sampler"):
        assert {r.path for r in case.told} <= paths
    elif case.op == "alias_move":
        with Catalog.open(data_dir=lineage.data) as catalog:
            history = all_pages(partial(catalog.alias_history, lineage.owner, case.policy, "prod"))
        # The setup's move and every acknowledged one are in the history (unacknowledged ones may be).
        assert history[-1].action == "set" and history[-1].to_revision == 1
        assert {reason for reason, _alias in case.told} <= {event.reason for event in history}
    elif case.op == "export":
        for exported in case.told:
            if isinstance(exported, tuple):
                revision, dest = exported
                files = sorted(dest.iterdir())
                assert payload.manifest_sha256(payload.hash_dir(files)) == revision.sha256
        # A client-side export is all or nothing: a dest is there complete, or not at all.
        exports = lineage.root / f"exports-{case.op}"
        if exports.exists():
            for dest in exports.iterdir():
                assert not dest.name.startswith("."), f"partial export {dest} left behind"
    elif case.op == "catalog_import":
        imported = {r.number: r.sha256 for r in listed.revisions.get(case.policies[1], [])}
        assert {(r.number, r.sha256) for r in case.told} <= imported.items()


def check_resumes(case: Case, lineage: Lineage, listed: Listed) -> None:
    """Every state this case saved loads and trains; every sampler checkpoint and revision samples."""
    server = lineage.server
    sc = tinker.ServiceClient(base_url=server.url, api_key=lineage.key)
    try:
        mine = [
            rid for rid, run in listed.runs.items() if (run.user_metadata or {}).get("policy") == case.policy
        ]
        assert mine, f"the run of {case.policy} is gone"
        checkpoints = [c for rid in mine for c in listed.checkpoints[rid]]
        trainers = [sc.create_training_client_from_state_with_optimizer(c.tinker_path)
                    for c in checkpoints if KIND_OF_TYPE[c.checkpoint_type] == "weights"]  # fmt: skip
        assert trainers
        steps = []
        for tc in (t.result() for t in trainers):
            steps.append((tc.forward_backward(batch(), "cross_entropy"), tc.optim_step(ADAM)))
        for fb, opt in steps:
            assert fb.result().metrics["loss:sum"] > 0
            opt.result()
        model_paths = [
            c.tinker_path for c in checkpoints if KIND_OF_TYPE[c.checkpoint_type] == "sampler_weights"
        ]
        model_paths += [f"tinker://{r.ref}" for p in case.policies for r in listed.revisions.get(p, [])]
        samples = [
            sc.create_sampling_client(model_path=path).result().sample(PROMPT, 1, ONE_TOKEN)
            for path in model_paths
        ]
        for path, sample in zip(model_paths, samples, strict=True):
            assert len(sample.result().sequences[0].tokens) == 1, path
    finally:
        sc.close("success").result()


@pytest.mark.parametrize("op", list(KILLERS))
def test_kill_9_during(op: str, lineage: Lineage) -> None:
    case = prepare(lineage, op)
    try:
        KILLERS[op](case, lineage.server, lineage)
    finally:
        lineage.server.kill(signal.SIGKILL)
        settle(case)
    lineage.restart()
    listed = check_consistent(lineage)
    check_told(case, lineage, listed)
    check_resumes(case, lineage, listed)


def test_overwrite_cut_between_its_renames_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    """The one window of an overwriting save the matrix cannot aim at: killed after the old data is
    moved aside and before the new data takes its place. The acknowledged checkpoint must survive
    the restart as it was (the record still describes it), not vanish with its missing dir."""
    run_id = "0" * 32 + ":train:0"
    store = RunStore(tmp_path / "runs")
    store.create_run(RunRecord(run_id, "owner", "base", {"rank": 4}, {}, "s", 0.0, 0.0))
    ref = CheckpointRef(run_id, "weights", "w0")
    old = store.staging_dir(run_id, "weights")
    (old / "state.bin").write_bytes(b"old")
    size = store.publish_data(ref, old)
    store.register_checkpoint(CheckpointRecord(run_id, "weights", "w0", "owner", 1.0, size))
    # What a kill leaves between publish_dir's two renames: the old dir aside, the new one staged.
    final = store.data_dir(ref)
    os.replace(final, final.with_name(f"{TRASH_PREFIX}w0-4242"))
    new = store.staging_dir(run_id, "weights")
    (new / "state.bin").write_bytes(b"new")

    reopened = RunStore(tmp_path / "runs")
    assert [r.ref for r in reopened.list_checkpoints(run_id)] == [ref]
    assert (final / "state.bin").read_bytes() == b"old"
    assert [p.name for p in final.parent.iterdir()] == ["w0"]  # trash and staging gone
