"""The Anthropic Messages face's operations: a wire format over the OpenAI face's chat path.

A Messages request becomes the `ChatRequest` it means (system → a system message, `tool_use` blocks
→ assistant `tool_calls`, `tool_result` blocks → `tool` messages, tools' `input_schema` → function
`parameters`, `tool_choice` any/tool → required/named) and is admitted, rendered, sampled and parsed
for tool calls by `OpenAIService` itself (`admit_chat`, `run`, `render_chat`): the same template,
tool-call parser, admission and engine request. Only the shapes differ, built here: the Message
object, Anthropic's stream events, stop reasons and usage. No HTTP here (routes.py).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from mint_server.api.anthropic.schemas import CountTokensRequest, MessagesRequest, _Chat
from mint_server.api.openai.errors import OpenAIError
from mint_server.api.openai.schemas import ChatRequest
from mint_server.api.openai.service import Choice, OpenAIService, Reply, message_content
from mint_server.serving.chat import ToolCall

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
_IGNORED_BLOCKS = ("thinking", "redacted_thinking")  # an SDK sends back what it got; these models never think aloud


def bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


class AnthropicService:
    def __init__(self, chat: OpenAIService) -> None:
        self.chat = chat

    # --- requests → the chat they mean -------------------------------------------------------------
    def to_chat(self, req: _Chat) -> ChatRequest:
        """The OpenAI chat request this Messages request means (checked: a 400 names what is wrong)."""
        if req.thinking is not None and req.thinking.get("type") != "disabled":
            raise bad("thinking: extended thinking is not supported by this server", "thinking")
        messages: list[dict[str, Any]] = []
        if isinstance(req.system, str):
            if req.system:
                messages.append({"role": "system", "content": req.system})
        elif req.system:
            messages.append({"role": "system", "content": [_text_block(b, f"system[{j}]")
                                                           for j, b in enumerate(req.system)]})  # fmt: skip
        for i, m in enumerate(req.messages):
            messages.extend(_messages(m.role, m.content, f"messages[{i}].content"))
        body: dict[str, Any] = {"model": req.model, "messages": messages}
        if req.tools:
            body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
        if req.tool_choice is not None:
            choice = _tool_choice(req.tool_choice)
            if choice is not None:
                body["tool_choice"] = choice
        if isinstance(req, MessagesRequest):
            body |= {"max_tokens": req.max_tokens, "stream": req.stream}
            for name in ("temperature", "top_p", "top_k"):
                if (value := getattr(req, name)) is not None:
                    body[name] = float(value) if name != "top_k" else value
            if req.stop_sequences:
                body["stop"] = list(req.stop_sequences)
        try:
            return ChatRequest.model_validate(body)
        except Exception as e:  # a block's field of the wrong type, caught by the chat's own schema
            raise bad(f"messages: {e}".splitlines()[0], "messages") from None

    # --- operations ----------------------------------------------------------------------------------
    async def admit(self, owner: str, req: MessagesRequest) -> tuple[Reply, ChatRequest]:
        chat = self.to_chat(req)
        # Anthropic's max_tokens is a ceiling: lowered to what the context leaves, never refused for it.
        return await self.chat.admit_chat(owner, chat, max_tokens_at_most=req.max_tokens), chat

    async def count_tokens(self, owner: str, req: CountTokensRequest) -> dict[str, Any]:
        chat = self.to_chat(req)
        self.chat.resolve(chat.model, owner)  # an unknown model is a 404, as on /messages
        rendered = await self.chat.render_chat(chat)
        return {"input_tokens": len(rendered.prompt)}

    async def message(self, reply: Reply, req: MessagesRequest) -> dict[str, Any]:
        async with contextlib.aclosing(self.chat.run(reply, stream=False)) as updates:
            async for _ in updates:
                pass
        (c,) = reply.choices
        content = []
        text = message_content(c) or ""
        if text or not c.tool_calls:
            content.append({"type": "text", "text": text})
        content += [_tool_use(t) for t in c.tool_calls]
        reason, sequence = _stop(c)
        return {**_envelope(reply, req), "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(reply)}  # fmt: skip

    async def stream(self, reply: Reply, req: MessagesRequest) -> AsyncIterator[dict[str, Any]]:
        """Anthropic's events: message_start, then per content block content_block_start / _delta /
        _stop (text as it is drawn; tool calls whole when the reply ends, as on the OpenAI face),
        message_delta (stop reason, output tokens), message_stop. Each event's name is its `type`."""
        (c,) = reply.choices
        start = {**_envelope(reply, req), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**_usage(reply), "output_tokens": 0}}  # fmt: skip
        yield {"type": "message_start", "message": start}
        blocks = 0  # content blocks opened so far
        text_open = False
        async with contextlib.aclosing(self.chat.run(reply, stream=True)) as updates:
            async for u in updates:
                if u.text:
                    if not text_open:
                        yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                        text_open, blocks = True, 1
                    yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": u.text}}
        if not text_open and not c.tool_calls:  # an empty reply is one empty text block, as non-streamed
            yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            text_open, blocks = True, 1
        if text_open:
            yield {"type": "content_block_stop", "index": 0}
        for call in c.tool_calls:
            block = _tool_use(call)
            yield {"type": "content_block_start", "index": blocks, "content_block": {**block, "input": {}}}
            yield {"type": "content_block_delta", "index": blocks,
                   "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}
            yield {"type": "content_block_stop", "index": blocks}
            blocks += 1
        reason, sequence = _stop(c)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": c.completion_tokens}}  # fmt: skip
        yield {"type": "message_stop"}


def _envelope(reply: Reply, req: MessagesRequest) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": req.model}


def _usage(reply: Reply) -> dict[str, int]:
    usage = reply.usage
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


def _stop(c: Choice) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and the stop sequence that ended the text, if one did)."""
    if c.finish_reason == "tool_calls":
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.text.stop_string is not None:
        return "stop_sequence", c.text.stop_string
    return "end_turn", None


def _tool_use(t: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(t.arguments)
    except ValueError:
        arguments = None
    return {"type": "tool_use", "id": f"toolu_{t.id.removeprefix('call_')}", "name": t.name,
            "input": arguments if isinstance(arguments, dict) else {}}  # fmt: skip


def _text_block(b: Any, where: str) -> dict[str, Any]:
    if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
        raise bad(f"{where}: must be a text block ({{\"type\": \"text\", \"text\": …}})", where.split("[")[0])
    return {"type": "text", "text": b["text"]}


def _messages(role: str, content: str | list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages (before the user's
    own text, as Anthropic orders them), tool_use blocks the assistant's `tool_calls`."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        at = f"{where}[{j}]"
        kind = b.get("type")
        if kind == "text":
            parts.append(_text_block(b, at))
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), at)}})
        elif kind == "tool_use" and role == "assistant":
            name, call_id, arguments = b.get("name"), b.get("id"), b.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                raise bad(f"{at}: a tool_use block needs id and name (strings) and input (an object)", "messages")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            if not isinstance(call_id := b.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id: required (the id of the tool_use block it answers)", "messages")
            result = b.get("content", "")
            text = result if isinstance(result, str) else "".join(
                _text_block(r, f"{at}.content[{k}]")["text"] for k, r in enumerate(result or []))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind in _IGNORED_BLOCKS and role == "assistant":
            continue
        else:
            raise bad(f"{at}.type: {kind!r} blocks are not supported in {role} messages here "
                      "(text, image; tool_use from the assistant, tool_result from the user)", "messages")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(p["text"] for p in parts)}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    elif parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the data: URL the chat path reads (a url source is passed on, and
    refused there by name: the server fetches nothing)."""
    if isinstance(source, dict) and source.get("type") == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and isinstance(data, str):
            return f"data:{media};base64,{data}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad(f"{where}.source: an image needs a base64 source (type, media_type, data)", "messages")


def _tool(t: Any, i: int) -> dict[str, Any]:
    if t.type not in (None, "custom"):
        raise bad(f"tools[{i}].type: {t.type!r}: Anthropic's server tools are not supported here; "
                  "define the tool by name and input_schema", "tools")  # fmt: skip
    fn: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    if t.input_schema is not None:
        fn["parameters"] = t.input_schema
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> Any:
    kind = choice.get("type")
    if kind in _TOOL_CHOICE:
        return _TOOL_CHOICE[kind]
    if kind == "tool":
        if not isinstance(name := choice.get("name"), str):
            raise bad("tool_choice.name: required with type 'tool'", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise bad(f"tool_choice.type: {kind!r} is not one of auto, any, tool, none", "tool_choice")
