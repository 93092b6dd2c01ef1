"""The OpenAI face's operations: model listing and resolution, completions and chat completions,
streamed or not. No HTTP here (routes.py turns these dicts into JSON and Server-Sent Events) and
no tensors (the engine samples; `mint_server.serving` renders chats and detokenizes).

A request's `model` is resolved once, when it is admitted, like a Tinker sampling session's path:
an alias that moves afterwards changes only later requests. Every response runs one engine sample
request per prompt; its tokens go through the same `TextStream` whether or not the client streams,
so streamed text always equals non-streamed text. A response whose client goes away sets its cancel
event (streams) and cancels its engine futures (`engine.cancel`): the engine drops its sequences and
frees their KV at its next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tinker import types

from mint_server.api.core import Core, same_base_model
from mint_server.api.openai.errors import OpenAIError
from mint_server.api.openai.schemas import MAX_CHOICES, ChatRequest, CompletionRequest, NamedTool, _Sampling
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.paths import PathError, is_checkpoint_path, parse_policy_ref
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.errors import CatalogError
from mint_server.engine.interface import (
    AdapterSource,
    EngineError,
    Priority,
    Prompt,
    SampleCancelled,
    SampleJob,
    TokenCallback,
    TopLogprobs,
)
from mint_server.serving.chat import (
    ChatError,
    ChatImage,
    ChatTemplate,
    ToolCall,
    ToolCallGate,
    forced_call_format,
)
from mint_server.serving.text import TextStream

log = logging.getLogger(__name__)
OWNED_BY = "mint"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@dataclass(frozen=True)
class ServedModel:
    """What a request samples from, pinned at admission."""

    model: str  # as the client named it (echoed in responses)
    source: AdapterSource | None  # None: the bare base model
    fingerprint: str  # the revision it resolved to: "NAME@N:sha256-prefix", or "base"


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


@dataclass
class RenderedChat:
    prompt: list[int]  # the tokens (with images: each image as its run of image tokens)
    parsed: Prompt | None  # the engine's parse, when the chat has images
    forced: dict[str, Any] | None  # the grammar of a call tool_choice forces
    parse_calls: bool  # tool calls in the reply are parsed (tools given, tool_choice not "none")


class Mailbox:
    """Carries tokens from the engine's thread to the event loop with one wakeup per batch of them
    (a decode step draws a token for every running stream at once), not one per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[asyncio.Queue, tuple]] = collections.deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: tuple) -> None:  # any thread
        self._items.append((queue, item))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # the loop
        self._scheduled = False  # before draining: a post that sees False schedules another pass
        while self._items:
            queue, item = self._items.popleft()
            queue.put_nowait(item)


class OpenAIService:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.engine = core.engine
        self._mailbox: Mailbox | None = None
        self._token_texts: dict[int, str] = {}  # each token's own text, for logprobs entries
        self.tokenized = 0  # texts tokenized for prompts (tests check that a refused giant never was)

    def mailbox(self) -> Mailbox:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.engine.model_dir)

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

    @cached_property
    def decode(self) -> Callable[[list[int]], str]:
        """Token ids → text without special tokens; straight through the Rust tokenizer when that
        is all transformers' decode would do (it runs for every streamed token)."""
        tok = self.tokenizer
        backend = getattr(tok, "_tokenizer", None)
        if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False):
            return lambda ids: backend.decode(ids, skip_special_tokens=True)
        return lambda ids: tok.decode(ids, skip_special_tokens=True)

    # --- models -----------------------------------------------------------------------------------
    def list_models(self, owner: str, limit: int, after: str | None) -> dict[str, Any]:
        """The base model, then each servable policy as NAME (its latest revision) and NAME@ALIAS."""
        catalog = self.core.policies.catalog
        data = [] if after else [self._model(self.engine.base_model, 0)]
        try:
            page = catalog.list_policies(owner, cursor=after, limit=limit)
            for policy in page.items:
                if policy.base_model != self.engine.base_model:
                    continue
                created = int(policy.created_at.timestamp())
                data.append(self._model(policy.name, created))
                cursor = None
                while True:
                    aliases = catalog.list_aliases(owner, policy.name, cursor=cursor, limit=1000)
                    data.extend(self._model(f"{policy.name}@{a.name}", created) for a in aliases.items)
                    if (cursor := aliases.next_cursor) is None:
                        break
        except CatalogError as e:  # a malformed `after` cursor
            raise OpenAIError(400, str(e), "after") from None
        return {"object": "list", "data": data, "has_more": page.next_cursor is not None,
                "next_cursor": page.next_cursor}  # fmt: skip

    def get_model(self, owner: str, model_id: str) -> dict[str, Any]:
        self.resolve(model_id, owner)
        return self._model(model_id, 0)

    @staticmethod
    def _model(model_id: str, created: int) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}

    def resolve(self, model: str, owner: str) -> ServedModel:
        """The base model's name, NAME, NAME@ALIAS|N|<sha prefix>, or a tinker:// path (a sampler
        checkpoint or a policy reference), pinned now."""
        if same_base_model(model, self.engine.base_model, self.engine.model_dir):  # as the Tinker face does
            return ServedModel(model, None, "base")
        try:
            ref = parse_policy_ref(model) if is_checkpoint_path(model) else model
            if ref is None:
                rec, run = self.core.resolve(model, owner)
                if rec.kind != "sampler_weights":  # training state is for resuming, not for serving
                    raise OpenAIError(400, f"model {model!r} is a {rec.kind} checkpoint; this face serves "
                                           "sampler weights (tinker://RUN/sampler_weights/NAME) and policy revisions",
                                      "model")  # fmt: skip
                source = self.core.source_of(rec, run)
                return ServedModel(model, source, source.key)
            revision, policy = self.core.policies.resolve(ref, owner)
            self.core.policies.check_servable(ref, policy)
        except NotFound as e:
            raise OpenAIError(404, f"model {model!r} not found: {e}", "model", "model_not_found") from None
        except (InvalidInput, PathError) as e:
            raise OpenAIError(400, f"model {model!r}: {e}", "model") from None
        # The Tinker face's own source for this revision, named by number so it stays the one resolved now.
        source = self.core.read_source(f"tinker://{revision.policy}@{revision.number}", owner)
        return ServedModel(model, source, f"{revision.policy}@{revision.number}:{revision.sha256[:12]}")

    # --- the engine -------------------------------------------------------------------------------
    def prepare(self, owner: str, target: ServedModel, prompt: list[int] | Prompt, n: int,
                params: types.SamplingParams, req: _Sampling, top_logprobs: int, response_format: dict[str, Any] | None,
                format_from: str = "response_format", prompt_logprobs: int | None = None) -> SampleJob:  # fmt: skip
        """Parse one prompt's engine job now, so bad input is a 400 before any stream starts.
        `format_from`: the request field the response_format came from (a forced tool call's is
        built from `tools`). `prompt_logprobs`: score the prompt too, with that many alternatives
        per position: the engine request the Tinker face makes for `prompt_logprobs` and
        `topk_prompt_logprobs` (one prefill scores the prompt and starts the samples)."""
        try:
            return self.engine.prepare_sample(
                target.source, prompt, n, params, prompt_logprobs is not None, prompt_logprobs or 0,
                key=owner, stop_at_eos=not req.ignore_eos, top_logprobs=top_logprobs,
                frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                min_p=req.min_p or 0.0, logit_bias=req.logit_bias, response_format=response_format,
                stop_token_ids=req.stop_token_ids, priority=Priority.lowered(req.priority, Priority.INTERACTIVE),
                logprobs_mode=req.logprobs_mode)
        except EngineError as e:  # the parser names Tinker's fields: say them as this face's
            name, _, why = str(e).partition(": ")
            name = _OPENAI_NAME.get(name, name.removeprefix("sampling_params."))
            if name == "prompt" and isinstance(req, ChatRequest):
                name = "messages"
            param = re.split(r"[.\[]", name, maxsplit=1)[0]  # response_format.json_schema → response_format
            if param == "response_format":
                param = format_from
            raise OpenAIError(400, f"{name}: {why}" if why else str(e), param if param in _ENGINE_FIELDS else None) from None

    async def sample(self, job: SampleJob, on_token: TokenCallback | None, cancel: threading.Event) -> types.SampleResponse:
        """The one place this face runs engine work (re-point it here when the engine boundary moves).
        A cold revision loads through the engine's residency manager like the Tinker sampler's."""
        # Only streams carry the callback and the event (neither crosses a process: see docs/openai.md).
        streamed = job.streaming(on_token, cancel) if on_token is not None else job
        future = self.engine.submit(streamed)
        try:
            result = await self.core.call(future)
        except asyncio.CancelledError:  # the client went away: stop the work and free its KV
            self.engine.cancel(future)
            raise
        self.core.note_sampled(job.key, job, result)
        return result

    # --- admission --------------------------------------------------------------------------------
    def _params(self, req: _Sampling, prompts: list[list[int]], max_tokens: int | None) -> types.SamplingParams:
        stops = req.stops()
        if len(prompts) * req.n > MAX_CHOICES:
            raise OpenAIError(400, f"n × prompts must be at most {MAX_CHOICES}", "n")
        context = self.engine.limits.max_context
        longest = max(len(p) for p in prompts)
        if longest >= context:  # before max_tokens: with it omitted, the prompt is what is at fault
            raise OpenAIError(400, f"the prompt ({longest} tokens) leaves no room in the model's context "
                                   f"length ({context})", "messages" if isinstance(req, ChatRequest) else "prompt")
        if max_tokens is None:  # OpenAI's default: the rest of the context
            max_tokens = context - longest
        # Everything else (stop bounds, token ids, prompt + max_tokens within the context) is the job
        # parser's rule, checked in `prepare`: one rule for both faces.
        top_k = req.top_k if req.top_k not in (None, 0) else -1
        return types.SamplingParams(
            # An explicit list replaces EOS ([] never stops); None stops at EOS. EOS is added back
            # next to stop strings by the engine's stop_at_eos unless the request ignores EOS.
            max_tokens=max_tokens, seed=req.seed, stop=stops if stops or req.ignore_eos else None, top_k=top_k,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
        )

    def _top_logprobs(self, asked: int | None, param: str) -> int:
        """Alternatives per token, within the engine's limit (OpenAI's own is 20 for chat, 5 for completions)."""
        most = self.engine.limits.max_top_logprobs
        if asked is not None and asked > most:
            raise OpenAIError(400, f"{param}: at most {most} alternatives per token on this server, got {asked}", param)
        return asked or 0

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
        self.core.admission.check_samples(len(prompts))
        choices = [Choice(i, TextStream(self.decode, req.stops()), ToolCallGate() if tools else None)
                   for i in range(len(prompts) * n)]  # fmt: skip
        return Reply(target, prompts, n, jobs, choices, score_only=score_only)

    # --- running ----------------------------------------------------------------------------------
    async def run(self, reply: Reply, stream: bool) -> AsyncIterator[Update]:
        """Updates for every choice until all have finished. Streaming gets one per token as the engine
        draws it; otherwise the tokens arrive with the result. Leaving early (the client went away)
        cancels what is still running."""
        mailbox = self.mailbox()
        events: asyncio.Queue[tuple[str, int, Any, Any]] = asyncio.Queue()
        tasks = []
        for k, engine_job in enumerate(reply.jobs):
            base = k * reply.n

            def on_token(i: int, token: int, logprob: float, top: TopLogprobs | None, base: int = base) -> None:
                mailbox.post(events, ("token", base + i, token, (logprob, top)))

            streamed = stream and not reply.score_only  # a scored prompt's one drawn token is never shown
            running = asyncio.ensure_future(self._one(reply, engine_job, on_token if streamed else None))
            # Through the mailbox too, so the result never overtakes the request's last tokens.
            running.add_done_callback(lambda t, k=k: mailbox.post(events, ("done", k, t, None)))
            tasks.append(running)
        self.core.admission.samples_started(len(tasks))
        self.core.metrics.streams.inc()
        pending = len(tasks)
        try:
            while pending:
                kind, index, value, scores = await events.get()
                if kind == "token":
                    if (update := self._push(reply.choices[index], value, *scores)) is not None:
                        yield update
                    continue
                pending -= 1
                done: asyncio.Future[types.SampleResponse] = value
                if done.cancelled():
                    raise SampleCancelled()
                if (error := done.exception()) is not None:
                    raise error
                result = done.result()
                reply.cached_tokens += result.prompt_cache_hit_tokens or 0
                if result.prompt_logprobs_np is not None:
                    reply.responses[index] = result
                for i, seq in enumerate(result.sequences):
                    choice = reply.choices[index * reply.n + i]
                    if reply.score_only:  # max_tokens 0: the choice is the prompt alone
                        choice.text.finish()
                        choice.finish_reason = "length"
                        yield Update(choice, finished=True)
                        continue
                    for update in self._finish(choice, seq):
                        yield update
        finally:
            self.core.metrics.streams.dec()
            if pending:
                reply.cancel.set()  # streams: the engine frees their KV at its next step
                for task in tasks:  # others (and streams still queued): `sample` cancels their engine work
                    task.cancel()
            for task in tasks:
                # Their errors (SampleCancelled, or a failure after another request's) are seen here only.
                task.add_done_callback(_consume)

    async def _one(self, reply: Reply, engine_job: SampleJob, on_token: TokenCallback | None) -> types.SampleResponse:
        try:
            return await self.sample(engine_job, on_token, reply.cancel)
        finally:
            self.core.admission.samples_done()

    @staticmethod
    def _push(choice: Choice, token: int, logprob: float, top: TopLogprobs | None) -> Update | None:
        if choice.text.stopped or choice.finish_reason is not None:
            return None  # tokens past a stop string, before the engine noticed: not shown
        text = choice.text.push(token)
        choice.logprobs.append(logprob)
        if top is not None:
            choice.tops.append(top)
        if choice.gate is not None:
            text = choice.gate.push(text)
        return Update(choice, text, [(token, logprob, top)])

    def _finish(self, choice: Choice, seq: types.SampledSequence) -> list[Update]:
        """The sequence's result: push the tokens the stream has not seen, then end the choice."""
        out = []
        seen = len(choice.text.tokens)
        tops = seq.topk_logprobs
        for j, (token, logprob) in enumerate(zip(seq.tokens[seen:], seq.logprobs[seen:], strict=False)):
            top = tops[seen + j] if tops is not None else None
            if (update := self._push(choice, token, logprob, top)) is not None:
                out.append(update)
        # The engine's logprobs are the truth (the streamed ones are the same numbers).
        choice.logprobs = list(seq.logprobs[: len(choice.text.tokens)])
        if tops is not None:
            choice.tops = [t or [] for t in tops[: len(choice.text.tokens)]]
        rest = choice.text.finish()
        choice.completion_tokens = len(seq.tokens)
        reason = "stop" if seq.stop_reason == "stop" or choice.text.stopped else "length"
        if choice.gate is not None:
            rest = choice.gate.push(rest)
            tail, choice.tool_calls = choice.gate.finish()
            rest += tail
            if choice.tool_calls:
                reason = "tool_calls"
        choice.finish_reason = reason
        out.append(Update(choice, rest, finished=True))
        return out

    # --- chat completions -------------------------------------------------------------------------
    async def admit_chat(self, owner: str, req: ChatRequest, max_tokens_at_most: int | None = None) -> Reply:
        """Checks, renders (off the event loop, after a byte bound) and parses a chat into its engine
        jobs. The one chat admission: the Anthropic face admits its requests here too, as ChatRequests.
        `max_tokens_at_most`: the request's max_tokens as a ceiling, lowered to what the context leaves
        (the Anthropic face's max_tokens) rather than refused when it does not fit."""
        self.core.admission.check_accepting()
        target = self.resolve(req.model, owner)  # an unknown model is a 404 whatever else is wrong
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        top_logprobs = self._top_logprobs(req.top_logprobs, "top_logprobs") if req.logprobs else 0
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
            raise OpenAIError(400, str(e), e.param) from None
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
        except EngineError as e:  # "prompt.chunks[j]: …" → the messages are at fault
            raise OpenAIError(400, f"messages: {str(e).partition(': ')[2] or e}", "messages") from None

    async def chat(self, reply: Reply, req: ChatRequest) -> dict[str, Any]:
        async with contextlib.aclosing(self.run(reply, stream=False)) as updates:
            async for _ in updates:
                pass
        choices = []
        for c in reply.choices:
            message: dict[str, Any] = {"role": "assistant", "content": message_content(c)}
            if c.tool_calls:
                message["tool_calls"] = [_tool_call(t) for t in c.tool_calls]
            choices.append({
                "index": c.index, "message": message, "finish_reason": c.finish_reason,
                "logprobs": self._chat_logprobs(c.text.tokens, c.logprobs, c.tops, req) if req.logprobs else None,
            })  # fmt: skip
        return reply.body(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", choices, usage=reply.usage)

    async def chat_stream(self, reply: Reply, req: ChatRequest) -> AsyncIterator[dict[str, Any]]:
        chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
        usage = req.stream_options is not None and req.stream_options.include_usage

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:  # usage only in the last chunk, when asked
            return reply.body(chunk_id, "chat.completion.chunk", choices, **({"usage": None} if usage else {}))

        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for c in reply.choices])  # fmt: skip
        async with contextlib.aclosing(self.run(reply, stream=True)) as updates:
            async for u in updates:
                for chunk_ in self._chat_chunks(u, req, chunk):
                    yield chunk_
        if usage:
            yield {**chunk([]), "usage": reply.usage}

    def _chat_chunks(self, u: Update, req: ChatRequest, chunk: Callable[[list[dict]], dict]) -> list[dict]:
        """The chunks one update becomes: its text (and logprobs), then, at the end, calls and finish."""
        out: list[dict] = []
        c = u.choice
        logprobs = self._chat_logprobs([t for t, _, _ in u.tokens], [lp for _, lp, _ in u.tokens],
                                       [top or [] for _, _, top in u.tokens], req) if req.logprobs and u.tokens else None
        if u.text or logprobs:
            out.append(chunk([{"index": c.index, "delta": {"content": u.text}, "logprobs": logprobs,
                               "finish_reason": None}]))  # fmt: skip
        if u.finished:
            if c.tool_calls:
                calls = [{"index": k, **_tool_call(t)} for k, t in enumerate(c.tool_calls)]
                out.append(chunk([{"index": c.index, "delta": {"tool_calls": calls}, "logprobs": None,
                                   "finish_reason": None}]))  # fmt: skip
            out.append(chunk([{"index": c.index, "delta": {}, "logprobs": None,
                               "finish_reason": c.finish_reason}]))  # fmt: skip
        return out

    def _token_text(self, token: int, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token}"
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _chat_logprobs(self, tokens: list[int], logprobs: list[float], tops: list[TopLogprobs],
                       req: ChatRequest) -> dict:  # fmt: skip
        as_ids = req.return_tokens_as_token_ids
        k = req.top_logprobs or 0

        def entry(t: int, lp: float) -> dict[str, Any]:
            text = self._token_text(t, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        entries = []
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            alternatives = [entry(a, alp) for a, alp in tops[i]] if k else []
            entries.append({**entry(t, lp), "top_logprobs": alternatives})
        return {"content": entries, "refusal": None}

    # --- completions ------------------------------------------------------------------------------
    async def admit_completion(self, owner: str, req: CompletionRequest) -> Reply:
        self.core.admission.check_accepting()
        target = self.resolve(req.model, owner)
        for name, bad in (("suffix", req.suffix is not None), ("best_of", req.best_of not in (None, req.n))):
            if bad:
                raise OpenAIError(400, f"{name} is not supported by this server", name)
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise OpenAIError(400, "max_tokens: 0 generates nothing; it is for scoring the prompt, with echo "
                                   "(and logprobs)", "max_tokens")
        top_logprobs = self._top_logprobs(req.logprobs, "logprobs")
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

    def _echo(self, reply: Reply, c: Choice) -> str:
        return self.decode(reply.prompts[c.index // reply.n])

    async def complete(self, reply: Reply, req: CompletionRequest) -> dict[str, Any]:
        async with contextlib.aclosing(self.run(reply, stream=False)) as updates:
            async for _ in updates:
                pass
        choices = []
        for c in reply.choices:
            echo = self._echo(reply, c) if req.echo else ""
            logprobs = self._completion_logprobs(c.text.tokens, c.logprobs, c.tops, req, len(echo)) \
                if req.logprobs is not None else None
            if logprobs is not None and req.echo:
                logprobs = self._with_prompt_logprobs(reply, c, req, logprobs)
            choices.append({"index": c.index, "text": echo + c.text.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})  # fmt: skip
        return reply.body(f"cmpl-{uuid.uuid4().hex}", "text_completion", choices, usage=reply.usage)

    async def complete_stream(self, reply: Reply, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        chunk_id = f"cmpl-{uuid.uuid4().hex}"
        usage = req.stream_options is not None and req.stream_options.include_usage
        offsets = {c.index: 0 for c in reply.choices}

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:  # usage only in the last chunk, when asked
            return reply.body(chunk_id, "text_completion", choices, **({"usage": None} if usage else {}))

        if req.echo and req.logprobs is not None:
            # The prompt's scores come with the engine's result: each choice whole, in one chunk, at its end.
            whole = await self.complete(reply, req)
            for choice in whole["choices"]:
                yield chunk([choice])
            if usage:
                yield {**chunk([]), "usage": reply.usage}
            return
        if req.echo:
            for c in reply.choices:
                echo = self._echo(reply, c)
                offsets[c.index] = len(echo)
                yield chunk([{"index": c.index, "text": echo, "logprobs": None, "finish_reason": None}])
        async with contextlib.aclosing(self.run(reply, stream=True)) as updates:
            async for u in updates:
                c = u.choice
                logprobs = None
                if req.logprobs is not None and u.tokens:
                    logprobs = self._completion_logprobs([t for t, _, _ in u.tokens], [lp for _, lp, _ in u.tokens],
                                                         [top or [] for _, _, top in u.tokens], req,
                                                         offsets[c.index])  # fmt: skip
                # Offsets count each token's own text, as the non-streamed response does.
                offsets[c.index] += sum(len(self._token_text(t, False)) for t, _, _ in u.tokens)
                if u.text or logprobs or u.finished:
                    yield chunk([{"index": c.index, "text": u.text, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason if u.finished else None}])  # fmt: skip
        if usage:
            yield {**chunk([]), "usage": reply.usage}

    def _with_prompt_logprobs(self, reply: Reply, c: Choice, req: CompletionRequest,
                              completion: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The prompt's entries (its first token: no logprob, no alternatives, as OpenAI's) before the
        completion's, from the engine's prompt scores: the numbers the Tinker face returns."""
        k = c.index // reply.n
        result = reply.responses[k]
        prompt = reply.prompts[k]
        lps = result.prompt_logprobs or [None] * len(prompt)
        tops = result.topk_prompt_logprobs
        as_ids = req.return_tokens_as_token_ids
        offsets, at = [], 0
        for t in prompt:  # offsets into the echoed text, which leaves special tokens out
            offsets.append(at)
            at += len(self.decode([t]))
        top = None
        if req.logprobs:
            top = []
            for i in range(len(prompt)):
                alternatives = tops[i] if tops is not None and i < len(tops) else None
                if i == 0 or alternatives is None:
                    top.append(None)
                    continue
                entry: dict[str, float] = {}
                for a, alp in alternatives:
                    entry.setdefault(self._token_text(a, as_ids), alp)
                top.append(entry)
        return {
            "tokens": [self._token_text(t, as_ids) for t in prompt] + completion["tokens"],
            "token_logprobs": [None, *lps[1:]] + completion["token_logprobs"],
            "top_logprobs": None if top is None else top + completion["top_logprobs"],
            "text_offset": offsets + completion["text_offset"],
        }

    def _completion_logprobs(self, tokens: list[int], logprobs: list[float], tops: list[TopLogprobs],
                             req: CompletionRequest, offset: int) -> dict[str, Any]:  # fmt: skip
        as_ids = req.return_tokens_as_token_ids
        texts = [self._token_text(t, as_ids) for t in tokens]
        starts = []
        for t in tokens:  # where each token's own text begins (its id form has no place in the text)
            starts.append(offset)
            offset += len(self._token_text(t, False))
        top = None
        if req.logprobs:  # one {text: logprob} per position, best first (tokens with the same text: the best)
            top = [{} for _ in tokens]
            for alternatives, out in zip(tops, top, strict=True):
                for a, alp in alternatives:
                    out.setdefault(self._token_text(a, as_ids), alp)
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": starts}


# Engine fields a refusal may name; the face's own names for them are the same.
_ENGINE_FIELDS = ("top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "priority",
                  "prompt", "messages", "max_tokens", "stop", "temperature", "top_p", "top_k", "seed", "n",
                  "logit_bias", "response_format", "stop_token_ids", "tools", "logprobs_mode")
_OPENAI_NAME = {"num_samples": "n"}


def message_content(c: Choice) -> str | None:
    """A finished chat choice's text: with tool calls, the text before the first (None if blank)."""
    content = c.text.text
    if c.tool_calls:
        content = content[: content.find("<tool_call>")] if "<tool_call>" in content else content
        content = content if content.strip() else None
    return content


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


def _tool_call(t: ToolCall) -> dict[str, Any]:
    return {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()

