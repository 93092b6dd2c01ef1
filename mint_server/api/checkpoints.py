"""The REST side of runs and checkpoints: listings, delete, publish, TTL, weights_info, and the
PEFT dir behind an archive download.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from tinker import types

from mint_server.api.auth import Principal
from mint_server.api.core import Core
from mint_server.api.paths import (
    CHECKPOINT_TYPE,
    CheckpointRef,
    check_name,
    check_run_id,
    parse_kind,
    parse_policy_ref,
)
from mint_server.api.runs import CheckpointRecord, NotFound, RunRecord
from mint_server.api.training import check_ttl
from mint_server.model.config import ModelConfig


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
        self.core = core
        self.runs = core.runs
        self._tied: bool | None = None

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

    def list_runs(self, p: Principal, limit: int, offset: int) -> types.TrainingRunsResponse:
        runs = self.runs.list_runs(p.owner)
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

    def list_owner_checkpoints(self, p: Principal, limit: int, offset: int) -> types.CheckpointsListResponse:
        recs = self.runs.list_owner_checkpoints(p.owner)
        return types.CheckpointsListResponse(
            checkpoints=[checkpoint_view(r) for r in recs[offset : offset + limit]],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(recs)),
        )

    def delete(self, p: Principal, ref: CheckpointRef) -> None:
        self.runs.get_checkpoint(ref, p.owner, write=True)
        self.core.forget_checkpoint(ref)
        self.runs.delete_checkpoint(ref)

    def set_public(self, p: Principal, ref: CheckpointRef, public: bool) -> None:
        rec = self.runs.get_checkpoint(ref, p.owner, write=True)
        rec.public = public
        self.runs.update_checkpoint(rec)

    def set_ttl(self, p: Principal, ref: CheckpointRef, ttl_seconds: int | None) -> None:
        rec = self.runs.get_checkpoint(ref, p.owner, write=True)
        rec.expires_at = check_ttl(ttl_seconds)
        self.runs.update_checkpoint(rec)

    def weights_info(self, p: Principal, tinker_path: str) -> types.WeightsInfoResponse:
        if (policy_ref := parse_policy_ref(tinker_path)) is not None:
            revision, policy = self.core.policies.resolve(policy_ref, p.owner)
            # The rank is the revision's own; the switches are the policy's (revisions do not record them).
            base_model, lora = policy.base_model, {**policy.lora_config, "rank": revision.rank}
        else:
            _rec, run = self.core.resolve(tinker_path, p.owner)
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
        """Whether the base shares its embedding with the output layer (archives name that LoRA apart)."""
        if self._tied is None:
            self._tied = ModelConfig.from_hf_dir(self.core.engine.model_dir).tie_word_embeddings
        return self._tied

    def readable(self, p: Principal, ref: CheckpointRef) -> CheckpointRecord:
        return self.runs.get_checkpoint(ref, p.owner)

    async def peft_dir(self, owner: str, ref: CheckpointRef) -> tuple[Path, Callable[[], None]]:
        """A PEFT adapter dir for the checkpoint, and how to clean up after reading it.

        Sampler weights are stored as PEFT already. A training state is in the engine's format, so
        it is loaded into a temporary adapter and exported.
        """
        rec = self.runs.get_checkpoint(ref, owner)
        if rec.kind == "sampler_weights":
            return self.runs.data_dir(ref), lambda: None
        run = self.runs.find_run(rec.run_id)
        if run is None:
            raise NotFound(f"checkpoint {ref.tinker_path!r} not found")
        source = self.core.source_of(rec, run)
        tmp = Path(tempfile.mkdtemp(dir=self.core.ephemeral_root, prefix="export-"))
        (tmp / "peft").mkdir()
        try:
            await self.core.call(self.core.engine.export_peft(source, tmp / "peft"))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp / "peft", lambda: shutil.rmtree(tmp, ignore_errors=True)

    def session_view(self, p: Principal, session_id: str) -> types.GetSessionResponse:
        s = self.core.sessions.get(session_id, p.owner)
        return types.GetSessionResponse(
            training_run_ids=list(s.model_ids),
            sampler_ids=list(s.sampler_ids),
            user_metadata={k: str(v) for k, v in s.user_metadata.items()} if s.user_metadata else None,
            display_name=s.display_name,
        )

    def list_sessions(self, p: Principal, limit: int, offset: int) -> types.ListSessionsResponse:
        sessions = self.core.sessions.owned(p.owner)
        return types.ListSessionsResponse(sessions=[s.session_id for s in sessions[offset : offset + limit]])
