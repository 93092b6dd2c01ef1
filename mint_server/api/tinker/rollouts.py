"""Rollout control for asynchronous RL: pause, resume and abort sampling (SGLang's pause / continue /
abort; trainers such as SkyRL, AReaL, slime and verl's async mode drive it around a weight update).

A target is a policy of the caller's (every sampling session reading any revision of it) or one
sampling session. Pausing holds the target's new sample requests before the engine (api/state/
pauses.py) until resumed, or until the pause's timeout; requests already running finish on the
revision their session pinned. Partial rollouts (in-flight sequences continuing on a new revision)
are refused by name. Aborting cancels the target's pending requests at once: queued ones are
dropped and running ones end at the engine's next step, freeing their KV blocks.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mint_server.api.auth.keys import Principal
from mint_server.api.core import Core
from mint_server.api.state.clients import SamplingSession
from mint_server.api.state.pauses import DEFAULT_PAUSE_S, MAX_PAUSE_S, MAX_PAUSES_PER_OWNER, Target
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.paths import parse_policy_ref
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.refs import parse_ref


class RolloutTarget(BaseModel):
    """Exactly one of `policy` (a policy name of the caller's) and `sampling_session_id`."""

    model_config = ConfigDict(extra="forbid")
    policy: str | None = Field(None, min_length=1, max_length=128)
    sampling_session_id: str | None = Field(None, min_length=1, max_length=512)

    @model_validator(mode="after")
    def _one_target(self) -> RolloutTarget:
        if (self.policy is None) == (self.sampling_session_id is None):
            raise ValueError("give exactly one of policy and sampling_session_id")
        return self


class PauseRequest(RolloutTarget):
    timeout_s: float = Field(DEFAULT_PAUSE_S, gt=0, le=MAX_PAUSE_S,
                             description="the pause ends by itself after this many seconds")
    in_flight: Literal["finish_on_pinned", "continue_on_new"] = Field(
        "finish_on_pinned", description="what running sequences do: finish on the revision their session pinned "
                                        "(continue_on_new, partial rollouts, is not supported)")


class AbortRequest(RolloutTarget):
    pass


class PauseResponse(BaseModel):
    kind: str
    name: str
    paused: bool
    remaining_s: float = 0.0


class AbortResponse(BaseModel):
    kind: str
    name: str
    aborted: int  # requests cancelled


def policy_of(sampler: SamplingSession) -> str | None:
    """The policy a sampling session reads, if it reads one (tinker://NAME@…)."""
    if sampler.model_path is None or (ref := parse_policy_ref(sampler.model_path)) is None:
        return None
    return parse_ref(ref).policy


def targets_of(sampler: SamplingSession) -> list[Target]:
    """What pausing can name for this session's requests."""
    policy = policy_of(sampler)
    return [("session", sampler.sampler_id), *([("policy", policy)] if policy else [])]


class RolloutControl:
    def __init__(self, core: Core) -> None:
        self.stores = core.stores
        self.policies = core.policies
        self.work = core.work
        self.pauses = core.stores.pauses

    def _target(self, p: Principal, req: RolloutTarget) -> Target:
        if req.sampling_session_id is not None:
            sampler = self.stores.samplers.get(req.sampling_session_id)
            if sampler is None or sampler.owner != p.owner:
                raise NotFound(f"sampling session {req.sampling_session_id!r} not found", field="sampling_session_id")
            return "session", sampler.sampler_id
        assert req.policy is not None
        self.policies.resolve(req.policy, p.owner)  # 404 for a policy the caller does not have
        return "policy", parse_ref(req.policy, field="policy").policy

    def pause(self, p: Principal, req: PauseRequest) -> PauseResponse:
        if req.in_flight != "finish_on_pinned":
            raise InvalidInput("continue_on_new (partial rollouts, running sequences moving to the new "
                               "revision) is not supported; running sequences finish on the revision their session "
                               "pinned", field="in_flight")
        target = self._target(p, req)
        if self.pauses.full(p.owner, target):
            raise InvalidInput(f"at most {MAX_PAUSES_PER_OWNER} paused targets per owner",
                               field="policy" if req.policy else "sampling_session_id")
        self.pauses.pause(p.owner, target, req.timeout_s)
        return PauseResponse(kind=target[0], name=target[1], paused=True, remaining_s=req.timeout_s)

    def resume(self, p: Principal, req: RolloutTarget) -> PauseResponse:
        target = self._target(p, req)
        self.pauses.resume(p.owner, target)
        return PauseResponse(kind=target[0], name=target[1], paused=False)

    def abort(self, p: Principal, req: AbortRequest) -> AbortResponse:
        target = self._target(p, req)
        sessions = [s for s in list(self.stores.samplers.values())
                    if s.owner == p.owner and target in targets_of(s)]  # fmt: skip
        aborted = 0
        for sampler in sessions:
            for request_id in list(sampler.pending):
                self.work.cancel_sample(request_id, p.owner)
                aborted += 1
        return AbortResponse(kind=target[0], name=target[1], aborted=aborted)

    def paused(self, p: Principal) -> list[dict[str, object]]:
        return self.pauses.paused(p.owner)
