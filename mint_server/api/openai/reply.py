"""What an OpenAI-face response is made of: the model it samples from (pinned at admission), its
choices and their updates as the engine draws tokens, and the envelope they go out in."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from mint_server.api.admission import Ticket
from mint_server.engine.interface import AdapterSource, SampleJob, TopLogprobs
from mint_server.serving.chat import ToolCall, ToolCallGate
from mint_server.serving.text import TextStream


@dataclass(frozen=True)
class ServedModel:
    """What a request samples from, pinned at admission."""

    model: str  # as the client named it (echoed in responses)
    source: AdapterSource | None  # None: the bare base model
    fingerprint: str  # the revision it resolved to: "NAME@N:sha256-prefix", or "base"
    policy: str | None = None  # the policy of that revision (pausing names it: api/state/pauses.py)


@dataclass
class Choice:
    index: int
    text: TextStream
    gate: ToolCallGate | None  # set when tool calls are parsed from this choice's text
    logprobs: list[float] = field(default_factory=list)  # of the tokens `text` accepted
    tops: list[TopLogprobs] = field(default_factory=list)  # their alternatives, when asked for
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    completion_tokens: int = 0


@dataclass
class Update:
    """What a choice gained: new text, the tokens (with logprobs and alternatives) that made it, or its end."""

    choice: Choice
    text: str = ""
    tokens: list[tuple[int, float, TopLogprobs | None]] = field(default_factory=list)
    finished: bool = False


@dataclass
class Reply:
    """One admitted response: its engine jobs (one per prompt, parsed at admission) and its choices."""

    target: ServedModel
    prompts: list[list[int]]
    n: int
    jobs: list[SampleJob]
    choices: list[Choice]
    # Its admission: held by `OpenAIService.run` until its engine requests end; a reply whose run
    # never starts (the client left first) has it closed by its route (`with reply.ticket`).
    ticket: Ticket
    created: int = field(default_factory=lambda: int(time.time()))
    cancel: threading.Event = field(default_factory=threading.Event)
    # `max_tokens: 0` (scoring the prompt): the engine draws one token (its least), which is dropped
    score_only: bool = False
    # each prompt's engine result, kept when the request asked for prompt logprobs (echo + logprobs)
    responses: dict[int, types.SampleResponse] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (its results' prompt_cache_hit_tokens)

    @property
    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def body(self, response_id: str, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A response or stream chunk of this reply, in OpenAI's envelope."""
        return {"id": response_id, "object": kind, "created": self.created, "model": self.target.model,
                "system_fingerprint": self.target.fingerprint, "choices": choices, **extra}



def message_content(c: Choice) -> str | None:
    """A finished chat choice's text: with tool calls, the text before the first (None if blank)."""
    content = c.text.text
    if c.tool_calls:
        content = content[: content.find("<tool_call>")] if "<tool_call>" in content else content
        content = content if content.strip() else None
    return content



def _tool_call(t: ToolCall) -> dict[str, Any]:
    return {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}

