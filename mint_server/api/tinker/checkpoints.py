"""The REST side of runs and checkpoints: listings, delete, publish, TTL, weights_info, and the
PEFT dir behind an archive download.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from tinker import types

from mint_server.api.auth.keys import Principal, random_id
from mint_server.api.core import Core
from mint_server.api.state.runs import CheckpointRecord, NotFound, RunRecord, check_project
from mint_server.api.tinker.paths import (
    CHECKPOINT_TYPE,
    CheckpointRef,
    check_name,
    check_run_id,
    parse_kind,
    parse_policy_ref,
)
from mint_server.api.tinker.revision_state import lora_of
from mint_server.api.tinker.saves import check_ttl
from mint_server.api.tinker.validate import InvalidInput


def _time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def checkpoint_view(rec: CheckpointRecord) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=rec.ref.checkpoint_id,
        checkpoint_type=CHECKPOINT_TYPE[rec.kind],
        time=_time(rec.created_at),
        tinker_path=rec.ref.tinker_path,
        size_bytes=rec.size_bytes,
        public=rec.public,
        user_metadata=rec.user_metadata,
        expires_at=_time(rec.expires_at) if rec.expires_at is not None else None,
    )


class CheckpointService:
    def __init__(self, core: Core) -> None:
        self.stores = core.stores
        self.policies = core.policies
        self.sources = core.sources
        self.work = core.work
        self.runs = core.stores.runs
        self._copies: dict[tuple[str, str], types.CopyWeightsResponse] = {}  # (owner, idempotency key) → answer

    def ref(self, run_id: str, kind: str, name: str) -> CheckpointRef:
        return CheckpointRef(check_run_id(run_id), parse_kind(kind), check_name(name))

    def run_view(self, run: RunRecord) -> types.TrainingRun:
        last = self.runs.last_checkpoint(run.run_id, "weights")
        last_sampler = self.runs.last_checkpoint(run.run_id, "sampler_weights")
        return types.TrainingRun(
            training_run_id=run.run_id,
            base_model=run.base_model,
            model_owner=run.owner,
            is_lora=True,
            lora_rank=run.lora.get("rank"),
            last_request_time=_time(run.last_request_time),
            last_checkpoint=checkpoint_view(last) if last else None,
            last_sampler_checkpoint=checkpoint_view(last_sampler) if last_sampler else None,
            user_metadata={k: str(v) for k, v in run.user_metadata.items()} if run.user_metadata else None,
        )

    def list_runs(self, p: Principal, limit: int, offset: int, project_id: str | None = None) -> types.TrainingRunsResponse:
        runs = self.runs.list_runs(p.owner, check_project(project_id))
        page = runs[offset : offset + limit]
        return types.TrainingRunsResponse(
            training_runs=[self.run_view(r) for r in page],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(runs)),
        )

    def get_run(self, p: Principal, run_id: str) -> types.TrainingRun:
        return self.run_view(self.runs.get_run(check_run_id(run_id), p.owner))

    def list_checkpoints(self, p: Principal, run_id: str) -> types.CheckpointsListResponse:
        run = self.runs.get_run(check_run_id(run_id), p.owner)
        return types.CheckpointsListResponse(
            checkpoints=[checkpoint_view(r) for r in self.runs.list_checkpoints(run.run_id)]
        )

    def list_owner_checkpoints(
        self, p: Principal, limit: int, offset: int, project_id: str | None = None
    ) -> types.CheckpointsListResponse:
        recs = self.runs.list_owner_checkpoints(p.owner, check_project(project_id))
        return types.CheckpointsListResponse(
            checkpoints=[checkpoint_view(r) for r in recs[offset : offset + limit]],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(recs)),
        )

    def copy_weights(self, p: Principal, req: types.CopyWeightsRequest, idempotency_key: str | None) -> types.CopyWeightsResponse:
        """A checkpoint the caller may read, copied into a new untrainable run of the caller's: into
        `destination_project_id`, or into a session's run slot (and that session's project). The
        copy shares the source's bytes (hard links) and has its own ttl; the source's is not inherited."""
        if idempotency_key is not None and (hit := self._copies.get((p.owner, idempotency_key))) is not None:
            return hit
        if req.weights_access_token is not None:
            raise InvalidInput("weights_access_token: access tokens are not supported by this server; copy "
                               "checkpoints you own or that are published")
        rec, run = self.sources.resolve(req.source_path, p.owner)
        expires = check_ttl(req.ttl_seconds)
        if req.session_id is not None:
            if req.model_seq_id is None or req.model_seq_id < 0:
                raise InvalidInput("model_seq_id (>= 0) is required with session_id")
            session = self.stores.sessions.live(req.session_id, p.owner)
            run_id, session_id, project = f"{session.session_id}:train:{req.model_seq_id}", session.session_id, \
                session.project_id
            if run_id in self.stores.models or self.runs.find_run(run_id) is not None:
                raise InvalidInput(f"model_seq_id {req.model_seq_id} was already used in this session")
        elif req.destination_project_id is not None:
            project, session_id = check_project(req.destination_project_id), ""
            run_id = f"{random_id()}:train:0"
        else:
            raise InvalidInput("copy_weights needs destination_project_id, or session_id with model_seq_id")
        now = time.time()
        new_run = RunRecord(run_id=run_id, owner=p.owner, base_model=run.base_model, lora=dict(run.lora),
                            optimizer=dict(run.optimizer), session_id=session_id, created_at=now,
                            last_request_time=now, project_id=project, trainable=False)
        ref = CheckpointRef(run_id, rec.kind, rec.name)
        size = self.runs.link_data(rec.ref, ref)
        self.runs.create_run(new_run)
        self.runs.register_checkpoint(CheckpointRecord(
            run_id=run_id, kind=rec.kind, name=rec.name, owner=p.owner, created_at=now, size_bytes=size,
            expires_at=expires, user_metadata=rec.user_metadata,
        ))
        answer = types.CopyWeightsResponse(tinker_path=ref.tinker_path)
        self.stores.meter.audit(p.owner, "checkpoint_copied", tinker_path=ref.tinker_path, source=rec.ref.tinker_path,
                                project_id=project)
        if idempotency_key is not None:
            self._copies[(p.owner, idempotency_key)] = answer
        return answer

    def delete(self, p: Principal, ref: CheckpointRef) -> None:
        self.runs.get_checkpoint(ref, p.owner, write=True)
        self.sources.forget_checkpoint(ref)
        self.runs.delete_checkpoint(ref)
        self.stores.meter.audit(p.owner, "checkpoint_deleted", tinker_path=ref.tinker_path, model_id=ref.run_id)

    def set_public(self, p: Principal, ref: CheckpointRef, public: bool) -> None:
        rec = self.runs.get_checkpoint(ref, p.owner, write=True)
        rec.public = public
        self.runs.update_checkpoint(rec)
        self.stores.meter.audit(p.owner, "checkpoint_published" if public else "checkpoint_unpublished",
                                tinker_path=ref.tinker_path, model_id=ref.run_id)

    def set_ttl(self, p: Principal, ref: CheckpointRef, ttl_seconds: int | None) -> None:
        rec = self.runs.get_checkpoint(ref, p.owner, write=True)
        rec.expires_at = check_ttl(ttl_seconds)
        self.runs.update_checkpoint(rec)
        self.stores.meter.audit(p.owner, "checkpoint_ttl_set", tinker_path=ref.tinker_path, model_id=ref.run_id,
                                ttl_seconds=ttl_seconds)

    def weights_info(self, p: Principal, tinker_path: str) -> types.WeightsInfoResponse:
        if (policy_ref := parse_policy_ref(tinker_path)) is not None:
            revision, policy = self.policies.resolve(policy_ref, p.owner)
            # The rank is the revision's own; the switches are the policy's (revisions do not record
            # them), or those its target modules imply (an imported adapter's policy).
            base_model, lora = policy.base_model, lora_of(revision.rank, policy.lora_config).model_dump()
        else:
            _rec, run = self.sources.resolve(tinker_path, p.owner)
            base_model, lora = run.base_model, run.lora
        return types.WeightsInfoResponse(
            base_model=base_model,
            is_lora=True,
            lora_rank=lora.get("rank"),
            train_mlp=lora.get("train_mlp"),
            train_attn=lora.get("train_attn"),
            train_unembed=lora.get("train_unembed"),
        )

    def tied_embeddings(self) -> bool:
        return self.sources.tied_embeddings()

    def readable(self, p: Principal, ref: CheckpointRef, purpose: str) -> CheckpointRecord:
        """A checkpoint `p` may read, about to be handed out (a download link): audited as a read."""
        rec = self.runs.get_checkpoint(ref, p.owner)
        self.stores.meter.audit(p.owner, "checkpoint_read", tinker_path=ref.tinker_path, model_id=ref.run_id,
                                purpose=purpose, reader=p.urn)
        if rec.owner != p.owner:  # a published checkpoint: its owner learns it was read, not by whom
            self.stores.meter.audit(rec.owner, "checkpoint_read", tinker_path=ref.tinker_path, model_id=ref.run_id,
                                    purpose=purpose, reader="another tenant")
        return rec

    def external_files(self, p: Principal, ref: CheckpointRef) -> tuple[CheckpointRecord, list[str]]:
        """An external weights checkpoint `p` may read, and its files (paths relative to its root)."""
        if ref.kind != "external_weights":
            raise InvalidInput(f"{ref.tinker_path!r} is not an external weights checkpoint "
                               "(tinker://<run>/external_weights/<name>, from save_weights_external)")
        rec = self.readable(p, ref, "download")
        root = self.runs.data_dir(ref)
        return rec, sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())

    def external_file(self, owner: str, ref: CheckpointRef, created_at: float, name: str) -> Path:
        """One file of an external weights checkpoint, as a signed URL names it; NotFound once the
        checkpoint is deleted, expired or replaced by a newer one of the same name."""
        rec = self.runs.get_checkpoint(ref, owner)
        root = self.runs.data_dir(ref)
        path = root / name
        if rec.created_at != created_at or not path.resolve().is_relative_to(root.resolve()) or not path.is_file():
            raise NotFound(f"{name!r} of {ref.tinker_path!r} not found")
        return path

    async def peft_dir(self, owner: str, ref: CheckpointRef) -> tuple[Path, Callable[[], None]]:
        """A PEFT adapter dir for the checkpoint, and how to clean up after reading it.

        Sampler weights are stored as PEFT already. A training state is in the engine's format, so
        it is loaded into a temporary adapter and exported.
        """
        rec = self.runs.get_checkpoint(ref, owner)
        if rec.kind == "external_weights":
            raise InvalidInput(f"{ref.tinker_path!r}: external weights have no archive; fetch their files "
                               "through external_weights_urls")
        if rec.kind == "sampler_weights":
            return self.runs.data_dir(ref), lambda: None
        run = self.runs.find_run(rec.run_id)
        if run is None:
            raise NotFound(f"checkpoint {ref.tinker_path!r} not found")
        source = self.sources.source_of(rec, run)
        tmp = Path(tempfile.mkdtemp(dir=self.stores.ephemeral_root, prefix="export-"))
        (tmp / "peft").mkdir()
        try:
            await self.work.call(self.work.engine.export_peft(source, tmp / "peft"))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp / "peft", lambda: shutil.rmtree(tmp, ignore_errors=True)

    def session_view(self, p: Principal, session_id: str) -> types.GetSessionResponse:
        s = self.stores.sessions.get(session_id, p.owner)
        return types.GetSessionResponse(
            training_run_ids=list(s.model_ids),
            sampler_ids=list(s.sampler_ids),
            user_metadata={k: str(v) for k, v in s.user_metadata.items()} if s.user_metadata else None,
            display_name=s.display_name,
        )

    def list_sessions(self, p: Principal, limit: int, offset: int) -> types.ListSessionsResponse:
        sessions = self.stores.sessions.owned(p.owner)
        return types.ListSessionsResponse(sessions=[s.session_id for s in sessions[offset : offset + limit]])
