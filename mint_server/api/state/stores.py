"""Stores: every registry the operations read and write, in one place. Durable (runs and their
checkpoints, per-run metrics, usage) and live (sessions, futures, training models, sampling
sessions, custom losses, pauses, recorded sequences, the first answers of resubmittable calls).

Everything here runs on the server's event loop, so plain dicts suffice."""

from __future__ import annotations

import shutil
from typing import Any

from tinker import types

from mint_server.api.settings import Settings
from mint_server.api.state.clients import CustomLoss, SamplingSession, TrainingModel
from mint_server.api.state.futures import FutureStore
from mint_server.api.state.pauses import PauseBoard
from mint_server.api.state.recorded import RecordedSequences
from mint_server.api.state.run_metrics import RunMetrics
from mint_server.api.state.runs import NotFound, RunStore
from mint_server.api.state.sessions import SessionRegistry
from mint_server.api.state.usage import PREFILL, SAMPLE, Meter
from mint_server.catalog.ledger import Ledger


class Stores:
    def __init__(self, settings: Settings, ledger: Ledger, base_model: str) -> None:
        self.runs = RunStore(settings.data_dir / "runs")
        self.run_metrics = RunMetrics(self.runs)  # per-step training curves
        self.meter = Meter(ledger, base_model)  # usage and audit, per tenant
        self.futures = FutureStore(settings.result_ttl_s)
        self.sessions = SessionRegistry(settings.session_ttl_s)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.custom_losses: dict[str, CustomLoss] = {}  # loss_id → uploaded loss (session-scoped)
        self.pauses = PauseBoard()  # paused sampling targets (rollout control): new samples wait there
        self.recorded = RecordedSequences()  # which live session recorded which sequences
        # (model or sampler id, seq_id) → first answer: a resubmitted request gets it again.
        self.dedupe: dict[tuple[str, int], types.UntypedAPIFuture] = {}
        # Snapshots behind save_weights_and_get_sampling_client live only as long as their session.
        self.ephemeral_root = settings.data_dir / "ephemeral"
        shutil.rmtree(self.ephemeral_root, ignore_errors=True)
        self.ephemeral_root.mkdir(parents=True, exist_ok=True)

    def model(self, model_id: str, owner: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise NotFound(f"model_id {model_id!r} not found (unknown, unloaded, or not yours)")
        return model

    def seen(self, scope: str, seq_id: int | None) -> types.UntypedAPIFuture | None:
        return self.dedupe.get((scope, seq_id)) if seq_id is not None else None

    def project_of(self, session_id: str | None) -> str | None:
        session = self.sessions.find(session_id) if session_id is not None else None
        return session.project_id if session is not None else None

    def note_sampled(self, owner: str, job: Any, result: types.SampleResponse, session_id: str | None = None) -> None:
        """Meter a finished sample request: its prompt once, and every token it drew."""
        project = self.project_of(session_id)
        self.meter.count(owner, PREFILL, len(job.prompt), session_id=session_id, project_id=project)
        drawn = sum(len(s.tokens) for s in result.sequences)
        self.meter.count(owner, SAMPLE, drawn, session_id=session_id, project_id=project)
