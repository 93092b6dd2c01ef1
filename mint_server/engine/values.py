"""Plain value types the engine's modules share: errors, the scheduling priority and streaming
callback of sample work, where a read-only adapter comes from, an adapter's optimizer state.

A leaf: it imports nothing of the engine, so every engine module (and the api, through
engine/interface.py) can use these without importing each other.
"""

from __future__ import annotations

import copy
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from torch import Tensor


class Priority(enum.IntEnum):
    """Scheduling class of sample work (lower runs first): interactive serving (the OpenAI face) ahead
    of RL rollouts (the Tinker sampler) ahead of sweeps and evals. A request may lower its own."""

    INTERACTIVE = 0
    ROLLOUT = 1
    BATCH = 2

    @classmethod
    def lowered(cls, name: str | None, default: Priority, field: str = "priority") -> Priority:
        """`name` ("interactive" | "rollout" | "batch"), never above `default`; EngineError naming
        `field` (where the request carried it) for anything else or for a raise."""
        if name is None:
            return default
        try:
            wanted = cls[str(name).upper()]
        except KeyError:
            raise EngineError(f"must be one of interactive, rollout, batch; got {name!r}", field=field) from None
        if wanted < default:
            raise EngineError(f"this request may lower its priority below {default.name.lower()} "
                              f"but not raise it; got {name!r}", field=field)
        return wanted


# Streaming: (sample index, token id, raw logprob, top) called on the engine's worker thread as each
# token is drawn; `top` is the job's `top_logprobs` most likely (token id, logprob) pairs, best
# first, or None when it asked for none. It must be quick and must not raise: hand the token to
# another thread and return.
TopLogprobs = list[tuple[int, float]]
TokenCallback = Callable[[int, int, float, TopLogprobs | None], None]


# The house form of a refusal's message, "FIELD: why", FIELD a path such as sampling_params.top_p,
# datums[3].loss_fn_inputs.weights or logit_bias['5'] (no spaces: "model 'x' is …: …" is not one).
_FIELD_FIRST = re.compile(r"([A-Za-z_][\w.\[\]'\"-]*): ")


class EngineError(ValueError):
    """A request the engine refuses (bad input; HTTP 400). `field`: the request field at fault, as a
    path (`sampling_params.top_p`, `datums[3].loss_fn_inputs.weights`), or None; `reason`: the
    message without it; `code`: a stable machine-readable reason, where the check gives one.
    `str(e)` is "FIELD: reason". Raise `EngineError(why, field=F)`; a message already in the house
    form ("F: why") is read into `field` here, once, so no handler ever parses an error's text."""

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None) -> None:
        if field is None and (first := _FIELD_FIRST.match(message)) is not None:
            field, message = first.group(1), message[first.end():]
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.reason, self.code = field, message, code

    @classmethod
    def from_error(cls, error: BaseException) -> EngineError:
        """`error` (a catalog refusal, a sequencing error) as this type: its text, field and code kept."""
        out = cls(str(error))
        out.field = getattr(error, "field", None) or out.field
        out.code = getattr(error, "code", None) or out.code
        return out

    def renamed(self, field: str | None) -> EngineError:
        """The same refusal (type, reason, code) naming its field as a face calls it."""
        out = copy.copy(self)
        out.field = field
        out.args = (f"{field}: {self.reason}" if field else self.reason,)
        return out


class NotSupportedError(EngineError):
    """A feature the engine does not implement; maps to HTTP 400 with a clear message."""

    def __init__(self, message: str, *, field: str | None = None, code: str | None = "not_supported") -> None:
        super().__init__(message, field=field, code=code)


class SampleCancelled(EngineError):
    """A sample that was cancelled (its cancel event set, its future cancelled, or its session
    ended): its sequences stopped and their KV blocks were freed. The one form of that error."""

    def __init__(self, message: str = "the request was cancelled") -> None:
        super().__init__(message, code="cancelled")


class EngineFailed(RuntimeError):
    """Part of the engine died (a tensor-parallel rank): the work it held fails with this, and so
    does any later work, at once, until the server is restarted (HTTP 503)."""


class AdapterLost(RuntimeError):
    """A training adapter's engine replica died and took the adapter's live state with it.

    Retryable: the service resumes the model from its last saved state on the next call (HTTP 503
    when raised at submit time; a `server` error on a future)."""


@dataclass
class AdamState:
    """An adapter's optimizer state (the family is fixed when the adapter is created)."""

    step: int = 0
    # target → per-family moments at the adapter's own rank, float32:
    # adamw (m_A, v_A, m_B, v_B); dimuon (momentum_A, momentum_B)
    moments: dict[str, tuple[Tensor, ...]] = field(default_factory=dict)
    family: str = "adamw"
    # AdamW: the (beta1, beta2) the moments were built with (None: not known, e.g. a state saved
    # before this was recorded: the next step's betas are adopted). See optim.adamw_step.
    betas: tuple[float, float] | None = None


@dataclass(frozen=True)
class AdapterSource:
    """Where a read-only adapter is read from. `key` names its content: equal keys share one adapter.

    Exactly one of: a PEFT dir; a training-state dir (its weights); `read`, a callable returning a
    PEFT payload's verified files (a catalog revision read from its blobs: it runs on a loader
    thread, never on the event loop or the engine worker).
    """

    key: str
    peft_dir: Path | None = None
    state_dir: Path | None = None
    read: Callable[[], dict[str, bytes]] | None = None

    @classmethod
    def of_revision(cls, sha256: str, read: Callable[[], dict[str, bytes]]) -> AdapterSource:
        """A catalog revision, keyed by its content (REVISION_KEY_PREFIX + sha256): revisions with equal
        bytes share one loaded adapter, which never goes stale; `read` returns its verified files."""
        return cls(REVISION_KEY_PREFIX + sha256, read=read)


REVISION_KEY_PREFIX = "rev:"  # AdapterSource keys of catalog revisions (engine.forget_source takes it)


class EngineReport(TypedDict):
    """What an engine tells /metrics at each scrape (LocalEngine.report; a fleet sums its replicas').
    Lists are handed over once (drained); counts are cumulative since the engine started."""

    resident: dict[str, int]  # adapters by tier: device, host, store
    loads: dict[str, int]  # adapter loads by source tier
    evictions: dict[str, int]  # by reason
    load_seconds: list[float]
    step_seconds: list[float]
    waiting_for_adapter: int
    kv_blocks_in_use: int
    sampler: dict[str, dict[str, float]]  # kind → phase → total
    latencies: list[tuple[int, str, float]]  # (priority, ttft | itl | queue, seconds)
    served: dict[str, float]  # fair-share key → tokens served
    step_tokens: dict[str, float]  # decode / prefill / training tokens
    calibration: dict[str, float]  # what start-up measured: skinny_rows, max_step_tokens, one-token step seconds …
