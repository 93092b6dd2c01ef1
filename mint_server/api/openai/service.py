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
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from typing import Any

from tinker import types

from mint_server.api.core import Core
from mint_server.api.openai.logprobs import Logprobs
from mint_server.api.openai.models import ServedModels
from mint_server.api.openai.reply import (  # noqa: F401  (re-exported: the Anthropic face builds on these)
    Choice,
    Reply,
    ServedModel,
    Update,
    _tool_call,
    message_content,
)
from mint_server.api.openai.requests import RenderedChat, Requests
from mint_server.api.openai.schemas import ChatRequest, CompletionRequest
from mint_server.engine.interface import SampleCancelled, SampleJob, TokenCallback, TopLogprobs
from mint_server.serving.chat import ChatTemplate

log = logging.getLogger(__name__)


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
    """The face's operations. Which model a request names is `models.py`'s job; turning its body into
    engine jobs, `requests.py`'s; logprobs' shapes, `logprobs.py`'s. This runs the jobs and shapes
    what they return."""

    def __init__(self, core: Core) -> None:
        self.metrics = core.metrics
        self.stores = core.stores
        self.work = core.work
        self.engine = core.work.engine
        self._mailbox: Mailbox | None = None
        self.models = ServedModels(core)
        self.requests = Requests(core, self.models, lambda ids: self.decode(ids))

    def mailbox(self) -> Mailbox:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    @property
    def tokenizer(self) -> Any:
        """The engine's own tokenizer: one per base per process, shared by both faces."""
        return self.engine.tokenizer

    @property
    def template(self) -> ChatTemplate:
        return self.requests.template

    @property
    def tokenized(self) -> int:
        return self.requests.tokenized

    @cached_property
    def decode(self) -> Callable[[list[int]], str]:
        """Token ids → text without special tokens; straight through the Rust tokenizer when that
        is all transformers' decode would do (it runs for every streamed token)."""
        tok = self.tokenizer
        backend = getattr(tok, "_tokenizer", None)
        if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False):
            return lambda ids: backend.decode(ids, skip_special_tokens=True)
        return lambda ids: tok.decode(ids, skip_special_tokens=True)

    @cached_property
    def logprobs(self) -> Logprobs:
        return Logprobs(self.tokenizer, self.decode)

    # --- what the routes and the Anthropic face call --------------------------------------------
    def list_models(self, owner: str, limit: int, after: str | None) -> dict[str, Any]:
        return self.models.list_models(owner, limit, after)

    def get_model(self, owner: str, model_id: str) -> dict[str, Any]:
        return self.models.get_model(owner, model_id)

    def resolve(self, model: str, owner: str) -> ServedModel:
        return self.models.resolve(model, owner)

    async def admit_chat(self, owner: str, req: ChatRequest, max_tokens_at_most: int | None = None) -> Reply:
        return await self.requests.admit_chat(owner, req, max_tokens_at_most)

    async def admit_completion(self, owner: str, req: CompletionRequest) -> Reply:
        return await self.requests.admit_completion(owner, req)

    async def render_chat(self, req: ChatRequest) -> RenderedChat:
        return await self.requests.render_chat(req)

    # --- the engine -------------------------------------------------------------------------------

    async def sample(self, job: SampleJob, on_token: TokenCallback | None, cancel: threading.Event) -> types.SampleResponse:
        """The one place this face runs engine work (re-point it here when the engine boundary moves).
        A cold revision loads through the engine's residency manager like the Tinker sampler's."""
        # Only streams carry the callback and the event (neither crosses a process: see docs/openai.md).
        streamed = job.streaming(on_token, cancel) if on_token is not None else job
        future = self.engine.submit(streamed)
        try:
            result = await self.work.call(future)
        except asyncio.CancelledError:  # the client went away: stop the work and free its KV
            self.engine.cancel(future)
            raise
        self.stores.note_sampled(job.key, job, result)
        return result

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
        # The admission ticket lasts until every engine request has ended (cancelled ones too).
        reply.ticket.hold(asyncio.gather(*tasks, return_exceptions=True))
        self.metrics.streams.inc()
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
            self.metrics.streams.dec()
            if pending:
                reply.cancel.set()  # streams: the engine frees their KV at its next step
                for task in tasks:  # others (and streams still queued): `sample` cancels their engine work
                    task.cancel()
            for task in tasks:
                # Their errors (SampleCancelled, or a failure after another request's) are seen here only.
                task.add_done_callback(_consume)

    async def _one(self, reply: Reply, engine_job: SampleJob, on_token: TokenCallback | None) -> types.SampleResponse:
        if reply.target.policy is not None:  # held here while its policy is paused (rollout control)
            await self.stores.pauses.wait(engine_job.key, [("policy", reply.target.policy)])
        return await self.sample(engine_job, on_token, reply.cancel)

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
                "logprobs": self.logprobs.chat(c.text.tokens, c.logprobs, c.tops, req) if req.logprobs else None,
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
        logprobs = self.logprobs.chat([t for t, _, _ in u.tokens], [lp for _, lp, _ in u.tokens],
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

    # --- completions ------------------------------------------------------------------------------
    def _echo(self, reply: Reply, c: Choice) -> str:
        return self.decode(reply.prompts[c.index // reply.n])

    async def complete(self, reply: Reply, req: CompletionRequest) -> dict[str, Any]:
        async with contextlib.aclosing(self.run(reply, stream=False)) as updates:
            async for _ in updates:
                pass
        choices = []
        for c in reply.choices:
            echo = self._echo(reply, c) if req.echo else ""
            logprobs = self.logprobs.completion(c.text.tokens, c.logprobs, c.tops, req, len(echo)) \
                if req.logprobs is not None else None
            if logprobs is not None and req.echo:
                logprobs = self.logprobs.with_prompt(reply, c, req, logprobs)
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
                    logprobs = self.logprobs.completion([t for t, _, _ in u.tokens], [lp for _, lp, _ in u.tokens],
                                                         [top or [] for _, _, top in u.tokens], req,
                                                         offsets[c.index])  # fmt: skip
                # Offsets count each token's own text, as the non-streamed response does.
                offsets[c.index] += sum(len(self.logprobs.token_text(t, False)) for t, _, _ in u.tokens)
                if u.text or logprobs or u.finished:
                    yield chunk([{"index": c.index, "text": u.text, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason if u.finished else None}])  # fmt: skip
        if usage:
            yield {**chunk([]), "usage": reply.usage}


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()

