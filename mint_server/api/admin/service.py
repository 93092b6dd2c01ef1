"""What a tenant reads about its own use of the server, beyond training and sampling: tinker 0.38's
`AdminClient` (audit log, usage events, current checkpoint storage), session search and project
moves, per-step run metrics, and evals comparing revisions. No HTTP here and no tensors.

A tenant is an owner id (every key of one owner sees the same data; see api/auth/keys.py). Usage is
self-hosted usage, not billing: every cost and rate field is null.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from pydantic import ValidationError
from tinker import types

from mint_server.api.auth.keys import Principal
from mint_server.api.catalog.evals import Evaluation, dataset_id, examples_from, resolve_targets
from mint_server.api.core import Core
from mint_server.api.state.runs import check_project
from mint_server.api.state.sessions import Session
from mint_server.api.state.usage import CHECKPOINT, PREFILL, SAMPLE, TRAINING
from mint_server.api.tinker.codec import describe_validation_error
from mint_server.api.tinker.mint_types import EvalRequest, EvalResponse, EvalRevisionResult, RunMetricsReport
from mint_server.api.tinker.validate import InvalidInput

# tinker's audit event types → the event name prefixes they cover (events are `<resource>_<action>`)
AUDIT_TYPES: dict[str, tuple[str, ...] | None] = {
    "all": None, "checkpoints": ("checkpoint_",), "projects": ("project_",), "teams": ("team_",),
    "organizations": ("organization_",),
}
MAX_USAGE_WINDOW = timedelta(days=14)
GB = 1e9


def _event_info(kind: str, quantity: float) -> Any:
    n = int(round(quantity))
    if kind == TRAINING:
        return types.TrainingBillingEvent(token_count=n)
    if kind == PREFILL:
        return types.SamplingPrefillBillingEvent(cached=False, token_count=n)
    if kind == SAMPLE:
        return types.SamplingSampleBillingEvent(token_count=n)
    if kind == CHECKPOINT:
        return types.CheckpointBillingEvent(count=n)
    raise ValueError(f"unknown usage kind {kind!r}")


def _status(session: Session) -> Any:
    if not session.closed:
        return types.SessionActive()
    if session.finish_reason is not None:
        return types.ClientSessionFinished(reason={"type": session.finish_reason})
    return None  # its heartbeats stopped: neither finished nor known to be running


class AdminService:
    def __init__(self, core: Core) -> None:
        self.stores = core.stores

    # --- audit log and usage -------------------------------------------------------------------
    async def audit_log(self, p: Principal, event_type: str, day: str | None) -> types.AuditLogResponse:
        if event_type not in AUDIT_TYPES:
            raise InvalidInput(f"event_type: must be one of {', '.join(AUDIT_TYPES)}; got {event_type!r}")
        try:
            when = date.fromisoformat(day) if day is not None else datetime.now(UTC).date()
            start = datetime.combine(when, time(), UTC)
            end = start + timedelta(days=1)
        except (ValueError, OverflowError):
            raise InvalidInput(f"day: expected a date YYYY-MM-DD before 9999-12-31; got {day!r}") from None
        await asyncio.to_thread(self.stores.meter.flush)
        entries = await asyncio.to_thread(self.stores.meter.ledger.audit, p.owner, start, end, AUDIT_TYPES[event_type])
        out = []
        for e in entries:
            checkpoint = e.event.startswith("checkpoint_")
            out.append(types.AuditLogEntry(
                timestamp=e.at, event=e.event, event_details=e.details,
                model_id=e.details.get("model_id") if checkpoint else None,
                tinker_path=e.details.get("tinker_path") if checkpoint else None,
                purpose=e.details.get("purpose") if e.event == "checkpoint_read" else None,
            ))
        return types.AuditLogResponse(entries=out)

    async def usage_events(self, p: Principal, query: dict[str, Any]) -> types.BillingUsageResponse:
        try:
            req = types.GetBillingUsageRequest.model_validate(query)
        except ValidationError as e:
            raise InvalidInput(describe_validation_error(e)) from None
        start, end = (t if t.tzinfo else t.replace(tzinfo=UTC) for t in (req.starting_on, req.ending_before))
        for name, t in (("starting_on", start), ("ending_before", end)):
            if (t.minute, t.second, t.microsecond) != (0, 0, 0):
                raise InvalidInput(f"{name}: must be aligned to a UTC hour boundary; got {t.isoformat()}")
        if start > datetime.now(UTC):
            raise InvalidInput("starting_on: must not be in the future")
        if not start < end <= start + MAX_USAGE_WINDOW:
            raise InvalidInput("ending_before: must be after starting_on and at most 14 days after it")
        await asyncio.to_thread(self.stores.meter.flush)
        rows = await asyncio.to_thread(self.stores.meter.ledger.usage, p.owner, start, end)
        events = [
            types.BillingUsageEvent(bucket_start=r.bucket_start, bucket_end=r.bucket_start + timedelta(hours=1),
                                    base_model=r.base_model, session_id=r.session_id, project_id=r.project_id,
                                    event_info=_event_info(r.kind, r.quantity))
            for r in rows
        ]
        events += self._storage_events(p.owner, start, min(end, datetime.now(UTC)))
        events.sort(key=lambda e: e.bucket_start)
        sessions = {}
        for sid in {e.session_id for e in events if e.session_id}:
            if (s := self.stores.sessions.find(sid)) is not None and s.owner == p.owner:
                meta = {k: str(v) for k, v in s.user_metadata.items()} if s.user_metadata else None
                sessions[sid] = types.BillingUsageSession(user_metadata=meta)
        return types.BillingUsageResponse(data=events, sessions=sessions)

    def _storage_events(self, owner: str, start: datetime, end: datetime) -> list[types.BillingUsageEvent]:
        """GB-hours of the checkpoints that exist now, over the hours of the window they existed in
        (a deleted checkpoint's past storage is not kept)."""
        gb_hours: dict[tuple[datetime, str | None], float] = defaultdict(float)
        for rec in self.stores.runs.list_owner_checkpoints(owner):
            run = self.stores.runs.find_run(rec.run_id)
            project = run.project_id if run is not None else None
            t = max(start, datetime.fromtimestamp(rec.created_at, UTC))
            while t < end:
                bucket = t.replace(minute=0, second=0, microsecond=0)
                upto = min(end, bucket + timedelta(hours=1))
                gb_hours[(bucket, project)] += rec.size_bytes / GB * (upto - t).total_seconds() / 3600
                t = upto
        return [types.BillingUsageEvent(bucket_start=b, bucket_end=b + timedelta(hours=1), project_id=project,
                                        event_info=types.StorageBillingEvent(gigabyte_hours=v))
                for (b, project), v in sorted(gb_hours.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))]

    def storage(self, p: Principal, project_id: str | None) -> types.CurrentCheckpointStorageUsageResponse:
        """The tenant's live checkpoints, counted and sized per project."""
        check_project(project_id)
        totals: dict[str | None, list[int]] = defaultdict(lambda: [0, 0])
        for rec in self.stores.runs.list_owner_checkpoints(p.owner, project_id):
            run = self.stores.runs.find_run(rec.run_id)
            item = totals[run.project_id if run is not None else None]
            item[0] += 1
            item[1] += rec.size_bytes
        return types.CurrentCheckpointStorageUsageResponse(data=[
            types.CurrentCheckpointStorageUsageItem(project_id=project, checkpoint_count=n, size_bytes=size,
                                                    size_gigabytes=size / GB)
            for project, (n, size) in sorted(totals.items(), key=lambda kv: kv[0] or "")
        ])

    # --- sessions ------------------------------------------------------------------------------
    def search_sessions(self, p: Principal, req: types.SessionSearchRequest) -> types.SessionSearchResponse:
        """The caller's sessions matching every filter, newest first, a page at a time. Every
        owner the caller may see is itself ("accessible" and "own" are the same here; a `user`
        owner list matches only the caller's own key URN or tenant)."""
        owner = req.owner
        if isinstance(owner, types.UserSearchOwner) and not {p.urn, p.owner} & set(owner.owner_urns):
            return types.SessionSearchResponse(sessions=[])
        if req.project_ids is not None:
            for pid in req.project_ids:
                check_project(pid)
        words = req.display_name.lower().split() if req.display_name else []

        def matches(s: Session) -> bool:
            named = [s.session_id == req.session_id] if req.session_id else []
            if words:
                named.append(all(w in (s.display_name or "").lower() for w in words))
            if named and not any(named):  # session_id and display_name: either one matches
                return False
            if req.project_ids is not None and s.project_id not in req.project_ids:
                return False
            meta = {k: str(v) for k, v in (s.user_metadata or {}).items()}
            if any(meta.get(k) != v for k, v in req.user_metadata.items()):
                return False
            return req.statuses is None or any(self._status_matches(s, q) for q in req.statuses)

        def order(s: Session) -> tuple[datetime, str]:  # the cursor's own precision: microseconds
            return (datetime.fromtimestamp(s.created_at, UTC), s.session_id)

        found = sorted((s for s in self.stores.sessions.owned(p.owner) if matches(s)), key=order, reverse=True)
        if req.cursor is not None:
            after = (req.cursor.last_created_at, req.cursor.last_session_id)
            found = [s for s in found if order(s) < after]
        page = found[:req.limit]
        summaries = [self._summary(s) for s in page]
        cursor = None
        if len(found) > req.limit:
            last_at, last_id = order(page[-1])
            cursor = types.SessionSearchCursor(last_created_at=last_at, last_session_id=last_id)
        return types.SessionSearchResponse(sessions=summaries, next_cursor=cursor)

    @staticmethod
    def _status_matches(s: Session, query: Any) -> bool:
        if query.type == "active":
            return not s.closed
        if query.type == "client_finished":
            return s.closed and s.finish_reason is not None and (query.reasons is None
                                                                 or s.finish_reason in query.reasons)
        return False  # cancelled (from a console) and failed sessions do not exist here

    def _summary(self, s: Session) -> types.SessionSummary:
        runs = [r.run_id for r in self.stores.runs.list_runs(s.owner) if r.session_id == s.session_id]
        checkpoints = [c for run_id in runs for c in self.stores.runs.list_checkpoints(run_id)]
        return types.SessionSummary(
            session_id=s.session_id, created_at=datetime.fromtimestamp(s.created_at, UTC), owner=s.owner,
            project_id=s.project_id or "", status=_status(s), checkpoints_count=len(checkpoints),
            display_name=s.display_name,
            user_metadata={k: str(v) for k, v in s.user_metadata.items()} if s.user_metadata else None,
            checkpoint_storage_bytes=sum(c.size_bytes for c in checkpoints),
        )

    def assign_project(self, p: Principal, session_id: str, body: dict[str, Any]) -> None:
        """Move a session, and the runs it made (so their checkpoints), into a project."""
        project = body.get("project_id")
        if not isinstance(project, str) or set(body) - {"project_id"}:
            raise InvalidInput("expected {'project_id': <project id>} (a session cannot be moved out of a project)")
        check_project(project)
        session = self.stores.sessions.get(session_id, p.owner)
        session.project_id = project
        for run in self.stores.runs.list_runs(p.owner):
            if run.session_id == session_id:
                self.stores.runs.set_project(run.run_id, project)
        self.stores.meter.audit(p.owner, "project_session_assigned", session_id=session_id, project_id=project,
                                actor=p.urn)

    # --- run metrics ---------------------------------------------------------------------------
    def run_metrics(self, owner: str, run_id: str, after: int) -> dict[str, Any]:
        run = self.stores.runs.get_run(run_id, owner)
        records, upto = self.stores.run_metrics.read(run.run_id, after)
        return {"run_id": run.run_id, "records": records, "next": upto}

    def report_metrics(self, p: Principal, run_id: str, body: RunMetricsReport) -> dict[str, Any]:
        run = self.stores.runs.get_run(run_id, p.owner)
        step = body.step
        if step is None:
            model = self.stores.models.get(run.run_id)
            if model is None:
                raise InvalidInput(f"step: required for run {run_id!r}, which is not loaded in this server")
            step = model.steps
        return self.stores.run_metrics.report(run.run_id, step, body.metrics)


class EvalService:
    """`POST /api/v1/mint/evals`: an eval comparing revisions, run as a future (api/catalog/evals.py)."""

    def __init__(self, core: Core, tokenizer: Any) -> None:
        self.admission = core.admission
        self.policies = core.policies
        self.work = core.work
        self._tokenizer = tokenizer  # () → the base model's tokenizer (loaded once, shared)

    def start(self, p: Principal, req: EvalRequest) -> types.UntypedAPIFuture:
        examples = examples_from(req.dataset, req.metric)
        dataset = dataset_id(req.dataset_name, examples)
        catalog = self.policies.catalog
        targets = resolve_targets(catalog, p.owner, req.revisions, self.work.engine.base_model)

        async def run() -> EvalResponse:
            # Tokenizing and parsing off the loop; the engine's futures are awaited, holding no thread.
            evaluation = await asyncio.to_thread(Evaluation, self.work.engine, self._tokenizer(), req.metric,
                                                 examples, max_tokens=req.max_tokens, chat=req.chat, key=p.owner)
            submitted = await asyncio.to_thread(evaluation.submit, targets)
            try:
                results = [(t, await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
                           for t, futures in submitted]
            finally:
                evaluation.cancel(submitted)
            scores = await asyncio.to_thread(lambda: [evaluation.score(t, r) for t, r in results])
            records = []
            if req.record:
                records = await asyncio.to_thread(catalog.record_evals, p.owner,
                                                  [(s.ref, s.value) for s in scores], req.metric, dataset=dataset)
            return EvalResponse(metric=req.metric, dataset=dataset, results=[
                EvalRevisionResult(revision=s.ref, sha256=s.sha256, value=s.value if math.isfinite(s.value) else 0.0,
                                   n=s.n, eval_id=records[i].id if records else None,
                                   outputs=s.outputs if req.include_outputs else None)
                for i, s in enumerate(scores)
            ])

        with self.admission.enter(p.owner) as ticket:
            return self.work.register(ticket, "eval", self.work.spawn(run()))
