"""The service behind the HTTP routes: composes the operation groups and owns the lifecycle
(background upkeep, session expiry, graceful shutdown). No HTTP here and no tensors.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mint_server.api.admin.service import AdminService, EvalService
from mint_server.api.auth.keys import Principal
from mint_server.api.core import Core
from mint_server.api.http.metrics import Metrics
from mint_server.api.openai.service import OpenAIService
from mint_server.api.settings import Settings
from mint_server.api.state.runs import check_project
from mint_server.api.state.sessions import Session
from mint_server.api.tinker.checkpoints import CheckpointService
from mint_server.api.tinker.extensions import MintService
from mint_server.api.tinker.rollouts import RolloutControl
from mint_server.api.tinker.sampling import SamplingService
from mint_server.api.tinker.training import TrainingService
from mint_server.catalog.catalog import Catalog
from mint_server.engine.interface import Engine

log = logging.getLogger(__name__)


class Service:
    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics, catalog: Catalog) -> None:
        self.core = Core(engine, settings, metrics, catalog)
        self.sampling = SamplingService(self.core)
        self.training = TrainingService(self.core, self.sampling.add_snapshot)
        self.checkpoints = CheckpointService(self.core)
        self.mint = MintService(self.core, self.training)
        self.rollouts = RolloutControl(self.core)
        self.openai = OpenAIService(self.core)
        self.admin = AdminService(self.core)
        self.evals = EvalService(self.core, lambda: self.openai.tokenizer)
        self._upkeep: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[Any]] = set()

    @property
    def engine(self) -> Engine:
        return self.core.work.engine

    # --- sessions ---------------------------------------------------------------------------------
    def create_session(self, p: Principal, user_metadata: dict[str, Any] | None, display_name: str | None,
                       project_id: str | None = None) -> str:
        self.core.admission.check_accepting()
        session = self.core.stores.sessions.create(p.owner, user_metadata, display_name, check_project(project_id))
        self.core.metrics.sessions.set(self.core.stores.sessions.active_count())
        return session.session_id

    def finish_session(self, p: Principal, session_id: str, reason: str | None = None) -> None:
        """Idempotent for the caller's own sessions; an unknown or another key's session is a 404,
        like every other cross-tenant call, and nothing changes. `reason` is what the client said."""
        session = self.core.stores.sessions.get(session_id, p.owner)
        if self.core.stores.sessions.close(session):
            session.finish_reason = reason
            self._retire_session(session, "session finished")

    def _retire_session(self, session: Session, reason: str) -> None:
        """Release what the session holds in the engine; checkpoints and run records stay."""
        for model_id in session.model_ids:
            if (model := self.core.stores.models.get(model_id)) is not None:
                task = asyncio.ensure_future(self.training.retire(model, reason))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
        losses = self.core.stores.custom_losses
        for loss_id in [k for k, c in losses.items() if c.session_id == session.session_id]:
            del losses[loss_id]
        for sampler_id in session.sampler_ids:
            if (sampler := self.core.stores.samplers.get(sampler_id)) is not None:
                self.sampling.retire(sampler)
        self.core.metrics.sessions.set(self.core.stores.sessions.active_count())

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._upkeep = asyncio.ensure_future(self._upkeep_loop())

    async def _upkeep_loop(self) -> None:
        interval = self.core.settings.upkeep_interval_s
        ticks = 0
        while True:
            await asyncio.sleep(interval)
            try:
                # Checkpoint TTLs are coarse (an hour at least): sweep them about once a minute.
                self.upkeep(sweep_checkpoints=ticks % max(1, int(60 / interval)) == 0)
            except Exception:
                log.exception("upkeep failed")
            try:
                await asyncio.to_thread(self.core.stores.meter.flush)
            except Exception:
                log.exception("writing usage and audit records failed (kept for the next try)")
            ticks += 1

    def upkeep(self, sweep_checkpoints: bool = True) -> None:
        for session in self.core.stores.sessions.take_expired():
            log.info("session %s missed its heartbeats; releasing its adapters", session.session_id)
            self._retire_session(session, "session expired (no heartbeat)")
        self.core.stores.futures.sweep()
        live = self.core.stores.futures.request_ids()
        for key in [k for k, answer in self.core.stores.dedupe.items() if answer.request_id not in live]:
            del self.core.stores.dedupe[key]
        if sweep_checkpoints and (expired := self.core.stores.runs.sweep_expired()):
            for ref in expired:
                self.core.sources.forget_checkpoint(ref)
            log.info("deleted %d expired checkpoints", len(expired))

    def begin_shutdown(self) -> None:
        """Refuse new work and answer held long polls now (try_again): the first thing on shutdown,
        before the server waits for open requests."""
        self.core.admission.accepting = False
        self.core.stores.futures.release_pollers()

    async def shutdown(self) -> None:
        """Refuse new work, finish what was accepted (up to drain_timeout_s), then stop the engine."""
        self.begin_shutdown()
        if self._upkeep is not None:
            self._upkeep.cancel()
        for model in self.core.stores.models.values():
            model.sequencer.drop_unreachable("server shut down before this request's predecessors arrived")
        left = await self.core.stores.futures.drain(self.core.settings.drain_timeout_s)
        if left:
            log.warning("shutdown: %d operations still running after %.0fs", left, self.core.settings.drain_timeout_s)
        await asyncio.to_thread(self.core.work.engine.shutdown, True)
        try:
            await asyncio.to_thread(self.core.stores.meter.flush)
        except Exception:
            log.exception("shutdown: the last usage and audit records could not be written")
