"""Request bodies of the Anthropic Messages face (`POST /v1/messages`, `/v1/messages/count_tokens`).

As on the OpenAI face, a request's own fields are honoured or refused by name: an unknown top-level
field is a 400 naming it; fields that change no output (`metadata`, `service_tier`, `cache_control`,
…) are accepted and ignored. Content blocks are checked by `service.py` when it turns them into the
chat the OpenAI face renders (an unknown block type is a 400 naming it). Strict types: no coercion.
Responses are plain dicts built in `service.py` (Anthropic's shapes).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolParam(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" (or absent): a client tool; Anthropic's server tools are refused


class _Chat(_Body):
    """What both routes read: the conversation and the tools it may call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: dict[str, Any] | None = None  # {"type": "auto" | "any" | "tool" | "none", "name"?}
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}: these models do not think aloud
    # Bookkeeping and hints that change no output: accepted and ignored.
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None


class MessagesRequest(_Chat):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # 0: no limit
    stream: bool = False


class CountTokensRequest(_Chat):
    pass
