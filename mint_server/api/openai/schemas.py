"""Request bodies of the OpenAI face. A request's own fields are honoured or refused by name, never
silently ignored: an unknown top-level field is a 400 naming it, as OpenAI answers ("Unrecognized
request argument"); only bookkeeping fields that change no output (`user`, `store`, `metadata`,
`service_tier`) are accepted and ignored. Inside messages and tools, unknown keys are ignored (SDKs
send back assistant messages with extra keys such as `refusal`). A field of the wrong type is a
400 naming it, with no coercion ("4" is not an integer, "yes" not a boolean: OpenAI answers both
with 400, strict mode here does the same). Responses are plain dicts built in `service.py` (OpenAI's shapes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 128  # n × prompts; the same bound as num_samples on the Tinker face


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): -1 or 0 = no limit
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # extension (vLLM's); the engine bounds it
    min_p: float | None = Field(None, ge=0, le=1)  # extension (vLLM's)
    logit_bias: dict[str, float] | None = None  # {token id: bias in [-100, 100]}; the engine checks them
    stop_token_ids: list[int] | None = None  # extension (vLLM's): stop tokens next to `stop` and EOS
    # extension (vLLM's): which logprobs `logprobs` reports; "processed_logprobs" is the distribution
    # the token was drawn from (after temperature, top-k/top-p/min-p, penalties, bias, grammar)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    # Structured output (engine/grammar.py parses it: json_object, json_schema, and the extensions
    # regex / lark and prefix / suffix; docs/openai.md). On completions too, as vLLM has it.
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Bookkeeping that changes no output: accepted and ignored.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    return_tokens_as_token_ids: bool = False  # extension (vLLM's): logprob tokens as "token_id:N"
    ignore_eos: bool = False  # extension (vLLM's): run to max_tokens or a stop string (benchmarks)
    # extension: scheduling class, "interactive" (the default here) or lowered to "rollout" / "batch"
    priority: str | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedTool(_Body):
    type: Literal["function"]
    function: dict[str, Any]


class ChatRequest(_Sampling):
    model_config = ConfigDict(extra="forbid", strict=True)
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the engine's max_top_logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None  # accepted: several calls in one answer are always parsed


class CompletionRequest(_Sampling):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with `echo` (and `logprobs`): score the prompt only, as evaluation harnesses ask
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # alternatives per token: at most the engine's max_top_logprobs
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
