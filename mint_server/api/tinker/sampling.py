"""Sampling sessions and sample requests.

A sampling session names what to sample from: the base model, a checkpoint, a policy revision
(pinned when the session is created), or an unnamed snapshot made by
save_weights_and_get_sampling_client. It hands the engine an `AdapterSource`; the engine's
residency manager loads, caches and evicts the adapter. Samples are not ordered: they run
concurrently and the engine batches them.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tinker import types

from mint_server.api.auth.keys import Principal
from mint_server.api.core import Core, sample_job
from mint_server.api.state.clients import SamplingSession, TrainingModel
from mint_server.api.state.futures import CompletionLog
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.codec import describe_validation_error
from mint_server.api.tinker.codec import (
    encode_prompt_extras as encode_prompt_extras,  # moved to codec; re-exported
)
from mint_server.api.tinker.mint_types import (
    EXTENSIONS_HEADER,
    MintSampleRequest,
    MintSamplingParams,
    SamplingExtensions,
)
from mint_server.api.tinker.rollouts import targets_of
from mint_server.api.tinker.validate import InvalidInput
from mint_server.api.work import waits_on_engine
from mint_server.engine.interface import AdapterSource


def _controls(params: MintSamplingParams, header: str | None) -> dict[str, Any]:
    """The sampling controls beyond tinker's own, from the body and the header (a field in both is refused)."""
    given = params.given()
    if header is None:
        return given
    try:
        extra = SamplingExtensions.model_validate_json(header).given()
    except ValidationError as e:
        raise InvalidInput(f"{EXTENSIONS_HEADER} header: {describe_validation_error(e)}") from None
    if both := sorted(extra.keys() & given.keys()):
        raise InvalidInput(f"sampling_params.{both[0]}: given both in the body and in the {EXTENSIONS_HEADER} header")
    return given | extra


def _prompt_fields(req: MintSampleRequest) -> dict[str, Any]:
    """tinker 0.38's prompt fields beyond prompt logprobs, for the engine's parser (which checks them)."""
    out: dict[str, Any] = {}
    if req.target_prompt_logprobs is not None:
        out["target_prompt_logprobs"] = req.target_prompt_logprobs
    if req.prompt_alt_tokens_k:
        out["prompt_alt_tokens_k"] = req.prompt_alt_tokens_k
    if req.prompt_logprobs_last_n is not None:
        out["prompt_logprobs_last_n"] = req.prompt_logprobs_last_n
    return out


CLONE_BLOCK = 1_000_000_000  # the SDK numbers a cloned client's samples from clone_id * 1e9


RETIRED_KEPT = 100_000  # ended sampling sessions remembered for late acknowledgements


class SamplingService:
    def __init__(self, core: Core) -> None:
        self.settings = core.settings
        self.admission = core.admission
        self.stores = core.stores
        self.sources = core.sources
        self.work = core.work
        self.engine = core.work.engine
        # Ended sampling sessions → owner, so an SDK poller's last acknowledgement that arrives after
        # its session finished gets an empty answer, not a 404 it would log as a failure.
        self._retired: OrderedDict[str, str] = OrderedDict()

    def create_session(
        self, p: Principal, req: types.CreateSamplingSessionRequest
    ) -> types.CreateSamplingSessionResponse:
        self.admission.check_accepting()
        session = self.stores.sessions.live(req.session_id, p.owner)
        sampler_id = f"{session.session_id}:sample:{req.sampling_session_seq_id}"
        if (existing := self.stores.samplers.get(sampler_id)) is not None:
            if existing.model_path != req.model_path:
                raise InvalidInput(f"sampling_session_seq_id {req.sampling_session_seq_id} was already used")
            return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)
        source: AdapterSource | None = None
        if req.model_path is not None:
            # A policy reference (tinker://NAME@prod) is resolved here, once: the session keeps that
            # revision even if the alias moves later.
            source = self.sources.read_source(req.model_path, p.owner)
            self.sources.check_base_model(req.base_model)
        elif req.base_model is None:
            raise InvalidInput("either model_path or base_model is required")
        else:
            self.sources.check_base_model(req.base_model)
        self.stores.samplers[sampler_id] = SamplingSession(
            sampler_id, p.owner, session.session_id, self.engine.base_model, req.model_path, source
        )
        session.sampler_ids.append(sampler_id)
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    def add_snapshot(self, model: TrainingModel, sampler_id: str, peft_dir: Path | None) -> None:
        """Register the sampling session created by save_weights_for_sampler without a path: on an
        exported snapshot, or (peft_dir None, kind="inflight") on the model's live adapter."""
        if peft_dir is None:
            sampler = SamplingSession(sampler_id, model.owner, model.session_id, self.engine.base_model, None, None, live=model)
        else:
            sampler = SamplingSession(
                sampler_id, model.owner, model.session_id, self.engine.base_model, None,
                AdapterSource(f"ephemeral:{sampler_id}", peft_dir=peft_dir), ephemeral_dir=peft_dir,
            )
        self.stores.samplers[sampler_id] = sampler
        session = self.stores.sessions.get(model.session_id, model.owner)
        session.sampler_ids.append(sampler_id)

    def sampler(self, p: Principal, sampler_id: str) -> SamplingSession:
        sampler = self.stores.samplers.get(sampler_id)
        if sampler is None or sampler.owner != p.owner:
            raise NotFound(f"sampling session {sampler_id!r} not found")
        return sampler

    def describe(self, p: Principal, sampler_id: str) -> types.GetSamplerResponse:
        s = self.sampler(p, sampler_id)
        return types.GetSamplerResponse(sampler_id=s.sampler_id, base_model=s.base_model, model_path=s.model_path)

    def asample(self, p: Principal, req: MintSampleRequest, priority: str | None = None,
                extensions: str | None = None) -> types.UntypedAPIFuture:
        """`extensions`: the X-Mint-Sampling-Params header (a JSON SamplingExtensions object), for
        clients that cannot send those fields in `sampling_params` (the tinker SDK drops them)."""
        if req.sampling_session_id is None:
            raise InvalidInput("sampling_session_id is required (create one with create_sampling_session)")
        sampler = self.sampler(p, req.sampling_session_id)
        if (hit := self.stores.seen(sampler.sampler_id, req.seq_id)) is not None:
            return hit  # already admitted: the first answer again, even while draining
        with self.admission.enter(p.owner, samples=1) as ticket:
            controls = _controls(req.sampling_params, extensions) | _prompt_fields(req)
            # An inflight session samples on the training model's own adapter (no copy): its newest weights.
            source = sampler.live.adapter() if sampler.live is not None else sampler.source
            job = sample_job(
                self.engine, p.owner, source, req.prompt, req.num_samples, req.sampling_params,
                bool(req.prompt_logprobs), req.topk_prompt_logprobs, record=bool(req.record_stability_info),
                top_logprobs=req.topk_sample_logprobs, priority=priority, controls=controls,
            )
            engine_wait: list[Any] = [None]

            async def run() -> types.SampleResponse:
                await self.stores.pauses.wait(p.owner, targets_of(sampler))  # held while paused (rollout control)
                waits_on_engine(engine_wait)
                result = await self.work.call(self.engine.submit(job))
                self.stores.note_sampled(p.owner, job, result, sampler.session_id)
                return result

            if job.record and job.sequence_ids:  # scope the records to this session (RecordedSequences.check)
                prefix = job.sequence_ids[0].rsplit("-", 1)[0]
                self.stores.recorded.note(prefix, p.owner, sampler.sampler_id)
                sampler.recorded.append(prefix)
            future = self.work.spawn(run())
            answer = self.work.register(
                ticket, "sample", future, scope=sampler.sampler_id, seq_id=req.seq_id,
                sample_sequence_ids=list(job.sequence_ids),  # the engine's ids: stability records use them
                engine_wait=engine_wait,
            )
        sampler.pending.add(answer.request_id)
        future.add_done_callback(lambda _f: sampler.pending.discard(answer.request_id))
        log = sampler.completions.setdefault((req.seq_id or 0) // CLONE_BLOCK, CompletionLog())
        future.add_done_callback(lambda f: log.add(answer.request_id, f))
        return answer

    async def retrieve_futures(self, p: Principal, req: types.FuturesRetrieveRequest) -> types.FuturesRetrieveResponse:
        """One long poll of a sampling session's completion queue (SDK `sample_use_retrieve_futures`).

        An acknowledgement-only poll (timeout 0) of the caller's own session that has ended answers
        "nothing new" with the cursor it sent: it only reports results as retrieved, and those are gone
        with the session. Anyone else's, or a waiting poll, is a 404 like any missing session."""
        sid = req.target.sampling_session_id
        if sid not in self.stores.samplers and req.timeout == 0 and self._retired.get(sid) == p.owner:
            return types.FuturesRetrieveResponse(completions=[], cursor=max(0, req.prev_cursor))
        sampler = self.sampler(p, sid)
        if req.prev_cursor < 0 or req.target.cloned_sampler_id < 0:
            raise InvalidInput("prev_cursor and target.cloned_sampler_id must be >= 0")
        limit = self.settings.long_poll_s
        timeout = limit if req.timeout is None else req.timeout
        if not (timeout >= 0):  # also NaN
            raise InvalidInput("timeout must be >= 0")
        log = sampler.completions.setdefault(req.target.cloned_sampler_id, CompletionLog())
        return await log.poll(req.prev_cursor, min(timeout, limit), self.stores.futures.closing)

    def retire(self, sampler: SamplingSession) -> None:
        """The session is over: its samples are abandoned, so they stop (queued or running) and
        free their KV; its snapshot and records go too."""
        self.stores.samplers.pop(sampler.sampler_id, None)
        self._retired[sampler.sampler_id] = sampler.owner
        while len(self._retired) > RETIRED_KEPT:
            self._retired.popitem(last=False)
        for request_id in list(sampler.pending):
            self.work.cancel_sample(request_id, sampler.owner)
        self.stores.recorded.expire(sampler.recorded)
        if sampler.ephemeral_dir is not None:
            self.work.engine.forget_source(f"ephemeral:{sampler.sampler_id}")
            shutil.rmtree(sampler.ephemeral_dir, ignore_errors=True)
