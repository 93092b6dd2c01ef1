"""Training runs and their checkpoints, persisted as JSON records under `<data dir>/runs`.

Layout of one run (`<rid>` is the run id with ':' replaced by '_'):

    runs/<rid>/run.json                          the run record
    runs/<rid>/<kind>/<name>/                    checkpoint data, written by the engine
    runs/<rid>/checkpoints/<kind>/<name>.json    the checkpoint record

Data is written to a staging dir and renamed into place before its record is written, so a record
always points at complete data. At load time, data without a record (a crash between the two) and
leftover staging dirs are removed. Every lookup checks the owner; a record of another owner is
reported exactly like a missing one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mint_server.api.tinker.paths import KINDS, CheckpointRef, Kind, check_name, check_run_id
from mint_server.api.tinker.validate import InvalidInput
from mint_server.fsutil import (
    atomic_write_json,
    dir_size,
    new_staging_dir,
    publish_dir,
    read_json,
    recover_replaced_dir,
)

log = logging.getLogger(__name__)


class NotFound(LookupError):
    """No such record for this owner (HTTP 404). `field`: the request field that named it, if known."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class RunRecord:
    run_id: str
    owner: str
    base_model: str
    lora: dict[str, Any]  # a tinker LoraConfig, dumped
    optimizer: dict[str, Any]
    session_id: str
    created_at: float
    last_request_time: float
    user_metadata: dict[str, Any] | None = None
    project_id: str | None = None  # the project of the session that created it (or of a copy)
    trainable: bool = True  # False: a copy_weights run, which holds checkpoints but never trains


PROJECT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_project(project_id: str | None) -> str | None:
    """A project id names a scope within one key: letters, digits, '_', '.', '-' (≤ 128)."""
    if project_id is not None and not PROJECT_ID.match(project_id):
        raise InvalidInput(f"project_id {project_id!r} must be 1-128 letters, digits, '_', '.' or '-'")
    return project_id


@dataclass
class CheckpointRecord:
    run_id: str
    kind: Kind
    name: str
    owner: str
    created_at: float
    size_bytes: int
    public: bool = False
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = field(default=None)

    @property
    def ref(self) -> CheckpointRef:
        return CheckpointRef(self.run_id, self.kind, self.name)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


def _run_dirname(run_id: str) -> str:
    return check_run_id(run_id).replace(":", "_")


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[str, RunRecord] = {}
        self._checkpoints: dict[CheckpointRef, CheckpointRecord] = {}
        root.mkdir(parents=True, exist_ok=True)
        self._load()

    # --- paths (only ever built from validated ids) ---------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.root / _run_dirname(run_id)

    def data_dir(self, ref: CheckpointRef) -> Path:
        return self.run_dir(ref.run_id) / ref.kind / check_name(ref.name)

    def _record_path(self, ref: CheckpointRef) -> Path:
        return self.run_dir(ref.run_id) / "checkpoints" / ref.kind / f"{check_name(ref.name)}.json"

    def staging_dir(self, run_id: str, kind: Kind) -> Path:
        return new_staging_dir(self.run_dir(run_id) / kind)

    # --- loading ----------------------------------------------------------------------------------
    def _load(self) -> None:
        for run_json in sorted(self.root.glob("*/run.json")):
            try:
                run = RunRecord(**read_json(run_json))
                check_run_id(run.run_id)
            except (OSError, ValueError, TypeError) as e:
                log.warning("skipping unreadable run record %s: %s", run_json, e)
                continue
            self._runs[run.run_id] = run
            for kind in KINDS:
                self._load_checkpoints(run, kind)

    def _load_checkpoints(self, run: RunRecord, kind: Kind) -> None:
        run_dir = self.run_dir(run.run_id)
        # A record's temp copy (atomic_write_json) a kill left half-written: its checkpoint never
        # existed, and the data without a record goes below.
        for partial in (run_dir / "checkpoints" / kind).glob(".*.tmp"):
            partial.unlink(missing_ok=True)
        for rec_json in sorted((run_dir / "checkpoints" / kind).glob("*.json")):
            try:
                rec = CheckpointRecord(**read_json(rec_json))
                check_name(rec.name)
            except (OSError, ValueError, TypeError) as e:
                log.warning("skipping unreadable checkpoint record %s: %s", rec_json, e)
                continue
            # A kill in the middle of an overwrite leaves the old data aside: the record still holds.
            if rec.run_id == run.run_id and rec.kind == kind and recover_replaced_dir(self.data_dir(rec.ref)):
                self._checkpoints[rec.ref] = rec
            else:
                rec_json.unlink(missing_ok=True)
        kind_dir = run_dir / kind
        if kind_dir.is_dir():
            for child in kind_dir.iterdir():
                known = CheckpointRef(run.run_id, kind, child.name) in self._checkpoints
                if not known:  # staging leftovers and data whose record was never written
                    shutil.rmtree(child, ignore_errors=True)

    # --- runs -------------------------------------------------------------------------------------
    def create_run(self, run: RunRecord) -> None:
        # Durable first: a record that cannot be written must not be listed (no phantom run).
        atomic_write_json(self.run_dir(run.run_id) / "run.json", asdict(run))
        self._runs[run.run_id] = run

    def touch(self, run_id: str) -> None:
        """Note activity in memory; it is written out with the next record change."""
        if run := self._runs.get(run_id):
            run.last_request_time = time.time()

    def set_project(self, run_id: str, project_id: str) -> None:
        run = self._runs[run_id]
        updated = RunRecord(**{**asdict(run), "project_id": project_id})
        atomic_write_json(self.run_dir(run_id) / "run.json", asdict(updated))  # durable first, then seen
        run.project_id = project_id

    def get_run(self, run_id: str, owner: str) -> RunRecord:
        run = self._runs.get(run_id)
        if run is None or run.owner != owner:
            raise NotFound(f"training run {run_id!r} not found")
        return run

    def find_run(self, run_id: str) -> RunRecord | None:
        return self._runs.get(run_id)

    def list_runs(self, owner: str, project_id: str | None = None) -> list[RunRecord]:
        runs = [r for r in self._runs.values() if r.owner == owner and project_id in (None, r.project_id)]
        return sorted(runs, key=lambda r: r.created_at, reverse=True)

    # --- checkpoints ------------------------------------------------------------------------------
    def link_data(self, src: CheckpointRef, dest: CheckpointRef) -> int:
        """Publish `src`'s data as `dest`'s by hard links: the copy shares every byte with the source
        (checkpoint data is immutable once published; an overwrite replaces the dir, not the files)."""
        staging = self.staging_dir(dest.run_id, dest.kind)
        try:
            root = self.data_dir(src)
            for f in sorted(root.rglob("*")):
                target = staging / f.relative_to(root)
                if f.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.link(f, target)
            return self.publish_data(dest, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def publish_data(self, ref: CheckpointRef, staging: Path) -> int:
        """Move a finished staging dir into place (filesystem only, safe off the event loop)."""
        publish_dir(staging, self.data_dir(ref))
        return dir_size(self.data_dir(ref))

    def register_checkpoint(self, rec: CheckpointRecord) -> CheckpointRecord:
        """Make published data a checkpoint: write its record (this is the commit point)."""
        atomic_write_json(self._record_path(rec.ref), asdict(rec))
        self._checkpoints[rec.ref] = rec
        if run := self._runs.get(rec.run_id):
            run.last_request_time = time.time()
            atomic_write_json(self.run_dir(run.run_id) / "run.json", asdict(run))
        return rec

    def exists(self, ref: CheckpointRef) -> bool:
        rec = self._checkpoints.get(ref)
        return rec is not None and not rec.expired(time.time())

    def get_checkpoint(self, ref: CheckpointRef, owner: str, *, write: bool = False) -> CheckpointRecord:
        """The record if `owner` may read it (own or published) or, with `write`, change it (own)."""
        rec = self._checkpoints.get(ref)
        if rec is None or rec.expired(time.time()) or (rec.owner != owner and (write or not rec.public)):
            raise NotFound(f"checkpoint {ref.tinker_path!r} not found")
        return rec

    def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        now = time.time()
        recs = [r for r in self._checkpoints.values() if r.run_id == run_id and not r.expired(now)]
        return sorted(recs, key=lambda r: r.created_at)

    def list_owner_checkpoints(self, owner: str, project_id: str | None = None) -> list[CheckpointRecord]:
        now = time.time()
        recs = [r for r in self._checkpoints.values() if r.owner == owner and not r.expired(now)
                and (project_id is None or (run := self._runs.get(r.run_id)) is not None and run.project_id == project_id)]
        return sorted(recs, key=lambda r: r.created_at, reverse=True)

    def update_checkpoint(self, rec: CheckpointRecord) -> None:
        atomic_write_json(self._record_path(rec.ref), asdict(rec))

    def delete_checkpoint(self, ref: CheckpointRef) -> None:
        # Record first: once it is gone the checkpoint no longer exists, even if rmtree is cut short.
        self._checkpoints.pop(ref, None)
        self._record_path(ref).unlink(missing_ok=True)
        shutil.rmtree(self.data_dir(ref), ignore_errors=True)

    def sweep_expired(self) -> list[CheckpointRef]:
        now = time.time()
        expired = [ref for ref, rec in self._checkpoints.items() if rec.expired(now)]
        for ref in expired:
            self.delete_checkpoint(ref)
        return expired

    def last_checkpoint(self, run_id: str, kind: Kind) -> CheckpointRecord | None:
        recs = [r for r in self.list_checkpoints(run_id) if r.kind == kind]
        return recs[-1] if recs else None
