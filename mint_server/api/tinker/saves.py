"""Training's save operations: a model's weights as a checkpoint (training state; sampler weights,
published as a catalog revision; an age-encrypted external archive) or as the snapshot one sampling
session reads. Each is an ordered operation of its model, run by the training service's
`sequenced`; the write fills a staging dir that is moved into place before its record makes it a
checkpoint.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tinker import types

from mint_server.api.auth.keys import Principal
from mint_server.api.core import Core
from mint_server.api.state.clients import TrainingModel
from mint_server.api.state.runs import CheckpointRecord
from mint_server.api.state.usage import CHECKPOINT
from mint_server.api.tinker.paths import CheckpointRef, Kind, check_name
from mint_server.api.tinker.validate import InvalidInput
from mint_server.fsutil import full_disk_named
from mint_server.model.peft_archive import write_archive_dir

MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600
Op = Callable[[], Awaitable[Any]]
# The training service's ordered-operation runner: (principal, model_id, seq_id, op name, check) → answer.
Sequenced = Callable[[Principal, str, int | None, str, Callable[[TrainingModel], Op]], types.UntypedAPIFuture]


def check_ttl(ttl_seconds: int | None) -> float | None:
    if ttl_seconds is None:
        return None
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidInput(f"ttl_seconds must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} (10 years)")
    return time.time() + ttl_seconds


MAX_AGE_RECIPIENTS = 10


def age_recipients(recipients: list[str] | None) -> list[Any]:
    """Parsed age recipients (native age1… keys or SSH public keys); 400 naming a bad one."""
    if not recipients:
        return []
    if len(recipients) > MAX_AGE_RECIPIENTS:
        raise InvalidInput(f"age_encryption_recipients: at most {MAX_AGE_RECIPIENTS} recipients")
    import pyrage

    parsed = []
    for i, r in enumerate(recipients):
        kind = pyrage.x25519.Recipient if r.startswith("age1") else pyrage.ssh.Recipient
        try:
            parsed.append(kind.from_str(r))
        except Exception as e:  # pyrage.RecipientError
            raise InvalidInput(f"age_encryption_recipients[{i}]: not an age or SSH public key ({e})") from None
    return parsed


def encrypt_files(directory: Path, recipients: list[Any]) -> None:
    """Replace every file with its age encryption, `<name>.age` (decrypt with `age -d -i KEY`)."""
    import pyrage

    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        f.with_name(f.name + ".age").write_bytes(pyrage.encrypt(f.read_bytes(), recipients))
        f.unlink()


def lora_shape(lora: types.LoraConfig | dict[str, Any]) -> dict[str, Any]:
    """What must match for a state to load into an adapter (the seed only affects initialization)."""
    d = lora.model_dump() if isinstance(lora, types.LoraConfig) else dict(lora)
    d.pop("seed", None)
    return d


class Saves:
    def __init__(self, core: Core, sequenced: Sequenced,
                 on_sampler_snapshot: Callable[[TrainingModel, str, Path | None], None]) -> None:
        self.stores = core.stores
        self.policies = core.policies
        self.sources = core.sources
        self.work = core.work
        self.engine = core.work.engine
        self.sequenced = sequenced
        self._on_sampler_snapshot = on_sampler_snapshot

    def save_weights(self, p: Principal, req: types.SaveWeightsRequest) -> types.UntypedAPIFuture:
        def check(model: TrainingModel) -> Op:
            ref = self._new_ref(model, "weights", req.path, req.overwrite)
            expires = check_ttl(req.ttl_seconds)

            async def run() -> types.SaveWeightsResponse:
                await self.save_checkpoint(
                    model.owner, ref, expires, req.user_metadata,
                    lambda dest: self.work.call(self.engine.save_state(model.adapter(), dest, True)),
                )
                model.saved = (self.stores.runs.data_dir(ref), True, model.steps)
                return types.SaveWeightsResponse(path=ref.tinker_path)

            return run

        return self.sequenced(p, req.model_id, req.seq_id, "save_weights", check)

    def save_weights_for_sampler(self, p: Principal, req: types.SaveWeightsForSamplerRequest) -> types.UntypedAPIFuture:
        def check(model: TrainingModel) -> Op:
            if req.path is None:
                return self._snapshot_for_sampling(model, req)
            ref = self._new_ref(model, "sampler_weights", req.path, overwrite=False)
            expires = check_ttl(req.ttl_seconds)

            async def publish(peft_dir: Path) -> None:
                model.last_revision = await self.policies.publish(
                    model.owner, model.policy, peft_dir, lora_config=lora_shape(model.lora),
                    parent=model.last_revision, training_run=model.model_id, step=model.steps,
                )

            async def run() -> types.SaveWeightsForSamplerResponseInternal:
                await self.save_checkpoint(
                    model.owner, ref, expires, req.user_metadata,
                    lambda dest: self.work.call(self.engine.export_peft(model.adapter(), dest)),
                    before_commit=publish,
                )
                return types.SaveWeightsForSamplerResponseInternal(path=ref.tinker_path)

            return run

        return self.sequenced(p, req.model_id, req.seq_id, "save_weights_for_sampler", check)

    def _snapshot_for_sampling(self, model: TrainingModel, req: types.SaveWeightsForSamplerRequest) -> Op:
        """save_weights_and_get_sampling_client: an unnamed export that one sampling session uses
        (kind="snapshot"), or a session on the model's live adapter slot (kind="inflight")."""
        if req.sampling_session_seq_id is None:
            raise InvalidInput("save_weights_for_sampler needs either path or sampling_session_seq_id")
        sampler_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
        if sampler_id in self.stores.samplers:
            raise InvalidInput(f"sampling_session_seq_id {req.sampling_session_seq_id} was already used")

        if req.kind == "inflight":
            async def inflight() -> types.SaveWeightsForSamplerResponseInternal:
                model.adapter()  # a failed or unloaded model has no weights to share
                self._on_sampler_snapshot(model, sampler_id, None)
                return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

            return inflight

        async def run() -> types.SaveWeightsForSamplerResponseInternal:
            dest = self.stores.ephemeral_root / sampler_id.replace(":", "_")
            dest.mkdir(parents=True, exist_ok=True)
            await self.work.call(self.engine.export_peft(model.adapter(), dest))
            self._on_sampler_snapshot(model, sampler_id, dest)
            return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

        return run

    def save_weights_external(self, p: Principal, req: types.SaveWeightsExternalRequest) -> types.UntypedAPIFuture:
        """The model's weights as a checkpoint `tinker://<run>/external_weights/<path>`: the adapter
        files an archive holds (PEFT layout, names the cookbook's merge accepts), each age-encrypted
        when recipients are given. Listed, TTL'd and deleted like any checkpoint; its files are
        fetched through the signed URLs of `external_weights_urls`."""
        def check(model: TrainingModel) -> Op:
            ref = self._new_ref(model, "external_weights", req.path, overwrite=False)
            expires = check_ttl(req.ttl_seconds)
            recipients = age_recipients(req.age_encryption_recipients)
            tied = self.sources.tied_embeddings()

            async def write(staging: Path) -> None:
                peft = Path(tempfile.mkdtemp(dir=self.stores.ephemeral_root, prefix="external-"))
                try:
                    await self.work.call(self.engine.export_peft(model.adapter(), peft))
                    await asyncio.to_thread(write_archive_dir, peft, staging, tied)
                finally:
                    shutil.rmtree(peft, ignore_errors=True)
                if recipients:
                    await asyncio.to_thread(encrypt_files, staging, recipients)

            async def run() -> types.SaveWeightsExternalResponseInternal:
                if self.stores.runs.exists(ref):  # two saves of one name raced past the check
                    raise InvalidInput(f"checkpoint {ref.tinker_path!r} already exists")
                await self.save_checkpoint(model.owner, ref, expires, None, write)
                size = self.stores.runs.get_checkpoint(ref, model.owner).size_bytes
                return types.SaveWeightsExternalResponseInternal(path=ref.tinker_path, size_bytes=size)

            return run

        return self.sequenced(p, req.model_id, req.seq_id, "save_weights_external", check)

    def _new_ref(self, model: TrainingModel, kind: Kind, name: str | None, overwrite: bool) -> CheckpointRef:
        if name is None:
            name = f"{kind}-{int(time.time() * 1000)}"
        ref = CheckpointRef(model.model_id, kind, check_name(name))
        if not overwrite and self.stores.runs.exists(ref):
            raise InvalidInput(f"checkpoint {ref.tinker_path!r} already exists (pass overwrite=True to replace it)")
        return ref

    async def save_checkpoint(
        self,
        owner: str,
        ref: CheckpointRef,
        expires_at: float | None,
        user_metadata: dict[str, str] | None,
        write: Callable[[Path], Awaitable[None]],
        before_commit: Callable[[Path], Awaitable[None]] | None = None,
    ) -> None:
        """Have `write` fill a staging dir, move it into place, then commit the record.

        `before_commit` (new checkpoints only) gets the data dir once it is durably in place, before
        the record makes it a checkpoint. If it fails, the data is removed and the save fails as a
        whole: a sampler checkpoint exists only once its catalog revision does. (A crash between
        the two leaves a complete revision, and data without a record, which the run store removes
        at startup.)
        """
        with full_disk_named(f"checkpoint {ref.kind}/{ref.name}"):
            staging = self.stores.runs.staging_dir(ref.run_id, ref.kind)  # making it may find the disk full too
            try:
                await write(staging)
                size = await asyncio.to_thread(self.stores.runs.publish_data, ref, staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            if before_commit is not None:
                try:
                    await before_commit(self.stores.runs.data_dir(ref))
                except BaseException:
                    shutil.rmtree(self.stores.runs.data_dir(ref), ignore_errors=True)
                    raise
        self.sources.forget_checkpoint(ref)  # an overwrite makes any cached copy stale
        self.stores.runs.register_checkpoint(
            CheckpointRecord(
                run_id=ref.run_id, kind=ref.kind, name=ref.name, owner=owner, created_at=time.time(),
                size_bytes=size, expires_at=expires_at, user_metadata=user_metadata,
            )
        )
        run = self.stores.runs.find_run(ref.run_id)
        session_id = run.session_id if run is not None else None
        self.stores.meter.count(owner, CHECKPOINT, 1, session_id=session_id,
                                project_id=self.stores.project_of(session_id))
        self.stores.meter.audit(owner, "checkpoint_created", tinker_path=ref.tinker_path, model_id=ref.run_id,
                              size_bytes=size)
