"""The OpenAI face's requests turned into the one sampling request: a completion's or a chat's body
becomes its prompts (tokenized, or rendered by the model's chat template) and the typed `SampleJob`s
the Tinker face builds too, through `sample_job` (api/core.py): the same parser and rules (every
bound is the engine's, checked once), the same fair admission by owner. What stays here is this face's own:
the wire shape (schemas.py), OpenAI's defaults (max_tokens: the rest of the context; 16 on
/completions), the byte bound that refuses a giant text before it is tokenized, and the names this
face gives the engine's fields in its errors (`CHAT`, `COMPLETIONS`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tinker import types

from mint_server.api.core import Core, SamplingFace, sample_job
from mint_server.api.openai.errors import OpenAIError
from mint_server.api.openai.models import ServedModels
from mint_server.api.openai.reply import Choice, Reply, ServedModel
from mint_server.api.openai.schemas import MAX_CHOICES, ChatRequest, CompletionRequest, NamedTool, _Sampling
from mint_server.engine.interface import EngineError, Priority, Prompt, SampleJob
from mint_server.serving.chat import ChatError, ChatImage, ChatTemplate, ToolCallGate, forced_call_format
from mint_server.serving.text import TextStream

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def _face_name(field: str, chat: bool) -> str:
    """The engine's field path as this face names it: its sampling_params.X are top-level fields;
    num_samples is n; a chat's prompt is its messages; /completions' top-k count is `logprobs`."""
    name = field.removeprefix("sampling_params.")
    if name == "num_samples":
        return "n"
    if name == "prompt" and chat:
        return "messages"
    if name == "top_logprobs" and not chat:
        return "logprobs"
    return name


# Interactive serving runs ahead of rollouts; a request may lower its own with the `priority` field.
CHAT = SamplingFace(Priority.INTERACTIVE, "priority", lambda field: _face_name(field, chat=True))
COMPLETIONS = SamplingFace(Priority.INTERACTIVE, "priority", lambda field: _face_name(field, chat=False))

# Request fields an engine refusal may name as `param` (a field path's first part); others get none.
_ENGINE_FIELDS = ("top_logprobs", "logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                  "priority", "prompt", "messages", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed",
                  "n", "logit_bias", "response_format", "stop_token_ids", "tools", "logprobs_mode")


@dataclass
class RenderedChat:
    prompt: list[int]  # the tokens (with images: each image as its run of image tokens)
    parsed: Prompt | None  # the engine's parse, when the chat has images
    forced: dict[str, Any] | None  # the grammar of a call tool_choice forces
    parse_calls: bool  # tool calls in the reply are parsed (tools given, tool_choice not "none")


class Requests:
    """Admits the face's requests: each becomes a `Reply` holding its parsed engine jobs, so bad input
    is a 400 before any stream starts. Uses the engine's own tokenizer (one per base per process)."""

    def __init__(self, core: Core, models: ServedModels, decode: Callable[[list[int]], str]) -> None:
        self.admission = core.admission
        self.engine = core.work.engine
        self.models = models
        self.decode = decode
        self.tokenized = 0  # texts tokenized for prompts (tests check that a refused giant never was)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @cached_property
    def max_prompt_bytes(self) -> int:
        """A prompt text of more UTF-8 bytes than this cannot fit the context, whatever it says, so it is
        refused before it is tokenized: no token covers more bytes of text than the vocabulary's longest
        entry spells (byte-level and byte-fallback spellings only overstate it), and the 4× margin
        covers normalizers that shrink a character (a 3-byte full-width letter to one ASCII byte)."""
        longest = max((len(t.encode()) for t in self.tokenizer.get_vocab()), default=1)
        return self.engine.limits.max_context * max(longest, 1) * 4

    async def _bound(self, size: int, param: str) -> None:
        """Refuse a text of `size` bytes at once when it cannot fit (the bound is computed off the loop once)."""
        if "max_prompt_bytes" not in self.__dict__:
            await asyncio.to_thread(lambda: self.max_prompt_bytes)
        if size > self.max_prompt_bytes:
            raise OpenAIError(400, f"{param} is {size} bytes of text: more than the model's context "
                                   f"({self.engine.limits.max_context} tokens) can hold, at most "
                                   f"{self.max_prompt_bytes} bytes; nothing was tokenized", param)  # fmt: skip

    def _tokenize(self, text: str) -> list[int]:
        """A prompt's tokens (run off the event loop: a long text takes seconds)."""
        self.tokenized += 1
        return list(self.tokenizer(text)["input_ids"])

    @cached_property
    def template(self) -> ChatTemplate:
        return ChatTemplate(self.tokenizer, self.engine.limits.image_tokens)

    # --- the one door ---------------------------------------------------------------------------
    def prepare(self, owner: str, target: ServedModel, prompt: list[int] | Prompt, n: int,
                params: types.SamplingParams, req: _Sampling, top_logprobs: int, response_format: dict[str, Any] | None,
                format_from: str = "response_format", prompt_logprobs: int | None = None) -> SampleJob:  # fmt: skip
        """One prompt's engine job, parsed now by `sample_job` (api/core.py; the door the Tinker face's
        samples take). `format_from`: the request field the response_format came from (a forced tool call's
        is built from `tools`). `prompt_logprobs`: score the prompt too, with that many alternatives
        per position: the engine request the Tinker face makes for `prompt_logprobs` and
        `topk_prompt_logprobs` (one prefill scores the prompt and starts the samples)."""
        chat = isinstance(req, ChatRequest)
        controls = dict(
            stop_at_eos=not req.ignore_eos, frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0, logit_bias=req.logit_bias, response_format=response_format,
            stop_token_ids=req.stop_token_ids, logprobs_mode=req.logprobs_mode)  # fmt: skip
        try:
            return sample_job(self.engine, owner, target.source, prompt, n, params, prompt_logprobs is not None,
                              prompt_logprobs or 0, top_logprobs=top_logprobs, priority=req.priority,
                              controls=controls, face=CHAT if chat else COMPLETIONS)  # fmt: skip
        except EngineError as e:  # its field already in this face's terms; `param` is the field's first part
            param = re.split(r"[.\[]", e.field or "", maxsplit=1)[0]  # response_format.json_schema → response_format
            if param == "response_format":
                param = format_from
            raise OpenAIError.from_error(e, 400, param if param in _ENGINE_FIELDS else None) from None

    def _params(self, req: _Sampling, prompts: list[list[int]], max_tokens: int | None) -> types.SamplingParams:
        stops = req.stops()
        if len(prompts) * req.n > MAX_CHOICES:
            raise OpenAIError(400, f"n × prompts must be at most {MAX_CHOICES}", "n")
        if max_tokens is None:  # OpenAI's default: the rest of the context (a prompt filling it: the engine's refusal)
            max_tokens = max(1, self.engine.limits.max_context - max(len(p) for p in prompts))
        # Everything else (the prompt within the context, stop bounds, token ids, prompt + max_tokens
        # within the context) is the job parser's rule, checked in `prepare`: one rule for both faces.
        top_k = req.top_k if req.top_k not in (None, 0) else -1
        return types.SamplingParams(
            # An explicit list replaces EOS ([] never stops); None stops at EOS. EOS is added back
            # next to stop strings by the engine's stop_at_eos unless the request ignores EOS.
            max_tokens=max_tokens, seed=req.seed, stop=stops if stops or req.ignore_eos else None, top_k=top_k,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
        )

    def _admit(self, owner: str, target: ServedModel, prompts: list[list[int]], n: int, params: types.SamplingParams,
               req: _Sampling, tools: bool, top_logprobs: int = 0, forced_call: dict[str, Any] | None = None,
               parsed: Prompt | None = None, prompt_logprobs: int | None = None, score_only: bool = False) -> Reply:  # fmt: skip
        """`forced_call`: the response_format of a tool call that `tool_choice` forces; `parsed`: the one
        prompt already parsed by the engine (a chat with images); `prompt_logprobs`: alternatives per
        prompt position when the prompt is scored too (None: not scored); `score_only`: nothing is
        generated (`max_tokens: 0`)."""
        fmt, source = (req.response_format, "response_format") if forced_call is None else (forced_call, "tools")
        jobs = [self.prepare(owner, target, parsed or p, n, params, req, top_logprobs, fmt, source, prompt_logprobs)
                for p in prompts]  # fmt: skip
        choices = [Choice(i, TextStream(self.decode, req.stops()), ToolCallGate() if tools else None)
                   for i in range(len(prompts) * n)]  # fmt: skip
        # Admitted last, with nothing left to refuse: the reply holds its ticket (see Reply.ticket).
        ticket = self.admission.enter(owner, samples=len(prompts))
        return Reply(target, prompts, n, jobs, choices, ticket, score_only=score_only)

    # --- chat completions -------------------------------------------------------------------------
    async def admit_chat(self, owner: str, req: ChatRequest, max_tokens_at_most: int | None = None) -> Reply:
        """Checks, renders (off the event loop, after a byte bound) and parses a chat into its engine
        jobs. The one chat admission: the Anthropic face admits its requests here too, as ChatRequests.
        `max_tokens_at_most`: the request's max_tokens as a ceiling, lowered to what the context leaves
        (the Anthropic face's max_tokens) rather than refused when it does not fit."""
        target = self.models.resolve(req.model, owner)  # an unknown model is a 404 whatever else is wrong
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else 0  # its bound is the engine's
        rendered = await self.render_chat(req)
        prompt = rendered.prompt
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens_at_most is not None:
            max_tokens = max(1, min(max_tokens_at_most, self.engine.limits.max_context - len(prompt)))
        params = self._params(req, [prompt], max_tokens)
        return self._admit(owner, target, [prompt], req.n, params, req, rendered.parse_calls, top_logprobs,
                           rendered.forced, rendered.parsed)

    async def render_chat(self, req: ChatRequest) -> RenderedChat:
        """A chat's prompt as the model's template writes it (tools included), off the event loop after a
        byte bound; with images, parsed by the engine. What admission samples from, and what the
        Anthropic face's count_tokens counts."""
        choice = req.tool_choice
        if choice is not None and not req.tools:
            raise OpenAIError(400, "tool_choice needs tools", "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        await self._bound(_message_bytes(req), "messages")
        forced = None
        try:
            prompt, images = await asyncio.to_thread(
                self.template.render_with_images, [m.model_dump(exclude_none=True) for m in req.messages], tools)
            if choice == "required" or isinstance(choice, NamedTool):  # the reply is a call, by grammar
                name = choice.function.get("name") if isinstance(choice, NamedTool) else None
                if isinstance(choice, NamedTool) and not isinstance(name, str):
                    raise ChatError("tool_choice.function.name: must be a function's name", "tool_choice")
                forced = forced_call_format(tools, name)
        except ChatError as e:
            raise OpenAIError.from_error(e, 400, e.param) from None
        if forced is not None and req.response_format is not None and req.response_format.get("type") != "text":
            raise OpenAIError(400, "tool_choice forces a tool call: response_format cannot shape the reply too",
                              "response_format")
        parsed = await asyncio.to_thread(self._with_images, prompt, images) if images else None
        if parsed is not None:
            prompt = list(parsed.tokens)  # each image as its run of image tokens: what the context holds
        return RenderedChat(prompt, parsed, forced, bool(tools) and choice != "none")

    def _with_images(self, tokens: list[int], images: list[ChatImage]) -> Prompt:
        """The rendered prompt with each image placeholder replaced by its image, parsed by the engine
        (which decodes the bytes and counts the image's tokens; the api never reads pixels)."""
        placeholder = self.engine.limits.image_tokens[1]  # type: ignore[index]  # set: the template took images
        chunks: list[types.ModelInputChunk] = []
        start, pending = 0, iter(images)
        for i, t in enumerate(tokens):
            if t == placeholder:
                if i > start:
                    chunks.append(types.EncodedTextChunk(tokens=tokens[start:i]))
                image = next(pending)
                chunks.append(types.ImageChunk(data=image.data, format=image.format))  # type: ignore[arg-type]
                start = i + 1
        if start < len(tokens):
            chunks.append(types.EncodedTextChunk(tokens=tokens[start:]))
        try:
            return self.engine.prepare_prompt(types.ModelInput(chunks=chunks))
        except EngineError as e:  # prompt.chunks[j] at fault: on this face, the messages
            raise OpenAIError.from_error(e.renamed("messages"), 400, "messages") from None

    # --- completions ------------------------------------------------------------------------------
    async def admit_completion(self, owner: str, req: CompletionRequest) -> Reply:
        target = self.models.resolve(req.model, owner)
        for name, bad in (("suffix", req.suffix is not None), ("best_of", req.best_of not in (None, req.n))):
            if bad:
                raise OpenAIError(400, f"{name} is not supported by this server", name)
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise OpenAIError(400, "max_tokens: 0 generates nothing; it is for scoring the prompt, with echo "
                                   "(and logprobs)", "max_tokens")
        top_logprobs = req.logprobs or 0  # alternatives per token: its bound is the engine's
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        if not prompts:
            raise OpenAIError(400, "prompt is empty", "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:  # before tokenizing: a text that cannot fit is refused at once
            await self._bound(len(text.encode()), "prompt")
        tokenized = iter(await asyncio.to_thread(lambda: [self._tokenize(t) for t in texts]) if texts else [])
        ids = [next(tokenized) if isinstance(p, str) else list(p) for p in prompts]
        max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        # max_tokens 0: the engine draws its least, one token, which the reply drops
        params = self._params(req, ids, max(max_tokens, 1))
        # echo + logprobs: the prompt's logprobs (and top_logprobs) too, the Tinker face's prompt_logprobs
        prompt_logprobs = top_logprobs if req.echo and req.logprobs is not None else None
        return self._admit(owner, target, ids, req.n, params, req, tools=False, top_logprobs=top_logprobs,
                           prompt_logprobs=prompt_logprobs, score_only=score_only)


def _message_bytes(req: ChatRequest) -> int:
    """UTF-8 bytes of the messages' text (content, text parts, tool-call arguments): a lower bound on
    what the template renders. Images are not text and are bounded by the engine's own rules."""
    size = 0
    for m in req.messages:
        if isinstance(m.content, str):
            size += len(m.content.encode())
        elif m.content:
            size += sum(len(t.encode()) for part in m.content if isinstance(t := part.get("text"), str))
        for call in m.tool_calls or ():
            size += len(call.function.arguments.encode())
    return size
