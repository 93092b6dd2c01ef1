"""Logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` and
the legacy completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset), with the
prompt's own scores in front when a completion echoes it. The numbers are the engine's, the same the
Tinker face returns; only their shape is this face's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mint_server.api.openai.reply import Choice, Reply
from mint_server.api.openai.schemas import ChatRequest, CompletionRequest
from mint_server.engine.interface import TopLogprobs


class Logprobs:
    def __init__(self, tokenizer: Any, decode: Callable[[list[int]], str]) -> None:
        self.tokenizer = tokenizer
        self.decode = decode
        self._token_texts: dict[int, str] = {}  # each token's own text, for logprobs entries

    def token_text(self, token: int, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token}"
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def chat(self, tokens: list[int], logprobs: list[float], tops: list[TopLogprobs], req: ChatRequest) -> dict:
        as_ids = req.return_tokens_as_token_ids
        k = req.top_logprobs or 0

        def entry(t: int, lp: float) -> dict[str, Any]:
            text = self.token_text(t, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        entries = []
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            alternatives = [entry(a, alp) for a, alp in tops[i]] if k else []
            entries.append({**entry(t, lp), "top_logprobs": alternatives})
        return {"content": entries, "refusal": None}

    def with_prompt(self, reply: Reply, c: Choice, req: CompletionRequest,
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
                    entry.setdefault(self.token_text(a, as_ids), alp)
                top.append(entry)
        return {
            "tokens": [self.token_text(t, as_ids) for t in prompt] + completion["tokens"],
            "token_logprobs": [None, *lps[1:]] + completion["token_logprobs"],
            "top_logprobs": None if top is None else top + completion["top_logprobs"],
            "text_offset": offsets + completion["text_offset"],
        }

    def completion(self, tokens: list[int], logprobs: list[float], tops: list[TopLogprobs],
                   req: CompletionRequest, offset: int) -> dict[str, Any]:  # fmt: skip
        as_ids = req.return_tokens_as_token_ids
        texts = [self.token_text(t, as_ids) for t in tokens]
        starts = []
        for t in tokens:  # where each token's own text begins (its id form has no place in the text)
            starts.append(offset)
            offset += len(self.token_text(t, False))
        top = None
        if req.logprobs:  # one {text: logprob} per position, best first (tokens with the same text: the best)
            top = [{} for _ in tokens]
            for alternatives, out in zip(tops, top, strict=True):
                for a, alp in alternatives:
                    out.setdefault(self.token_text(a, as_ids), alp)
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": starts}

