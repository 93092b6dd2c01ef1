"""Chat prompts and tool calls: OpenAI-style messages through the model's own chat template, and
tool calls found in generated text. No HTTP and no tensors here; the tokenizer is transformers'.

Tool calls are read in the Hermes format that Qwen2.5/Qwen3, Hermes and SmolLM3 templates teach
their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first `<tool_call>` is the message's content.

Images (vision-language models): an `image_url` content part must carry the image itself as a
`data:image/png|jpeg;base64,…` URL; a remote URL is refused by name (the server fetches nothing). The
image is written into the message text as the model's own marker (`<|vision_start|><|image_pad|>
<|vision_end|>` for Qwen3-VL, what its template writes for an image), so the rendered prompt holds one
image token per image; the engine reads the bytes and widens that token to the image's token count.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)


class ChatError(ValueError):
    """A chat request the template cannot render; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ChatImage:
    """An image of a chat request, as sent (the engine decodes it)."""

    data: bytes
    format: str  # png | jpeg (the Tinker ImageChunk formats)


IMAGE_MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}


class ChatTemplate:
    """Renders messages (plain dicts in OpenAI's shape) to prompt token ids with the tokenizer's template.

    image_tokens: (vision start, image placeholder, vision end) token ids of a vision-language model
    (EngineLimits.image_tokens); None refuses image parts."""

    def __init__(self, tokenizer: Any, image_tokens: tuple[int, int, int] | None = None) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.source = template if isinstance(template, str) else ""
        # A template that never reads `tools` would drop them silently: refuse tools for it instead.
        self.supports_tools = bool(re.search(r"\btools\b", self.source))
        self.image_tokens = image_tokens
        self.image_text = "".join(tokenizer.convert_ids_to_tokens(list(image_tokens))) if image_tokens else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        tokens, images = self.render_with_images(messages, tools)
        if images:
            raise ChatError("these messages hold images: render them with render_with_images", "messages")
        return tokens

    def render_with_images(self, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[ChatImage]]:
        """Prompt token ids, with one image placeholder token per image, and the images in order."""
        if not self.source:
            raise ChatError("this model has no chat template; use /completions", "messages")
        if tools and not self.supports_tools:
            raise ChatError("this model's chat template does not support tools", "tools")
        from jinja2 import TemplateError

        images: list[ChatImage] = []
        try:
            text = self.tokenizer.apply_chat_template(
                [_template_message(m, i, images, self.image_text) for i, m in enumerate(messages)],
                tools=tools or None, add_generation_prompt=True, tokenize=False,
            )
        except TemplateError as e:  # e.g. raise_exception("roles must alternate")
            raise ChatError(f"the chat template refused these messages: {e}", "messages") from None
        tokens = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.image_tokens is not None and tokens.count(self.image_tokens[1]) != len(images):
            raise ChatError(f"the messages' text holds the image placeholder {self.image_text!r} itself; "
                            "send images as image_url parts", "messages")
        return tokens, images


def _template_message(m: dict[str, Any], index: int, images: list[ChatImage] | None = None,
                      image_text: str | None = None) -> dict[str, Any]:
    """One message as chat templates expect it: text content, tool-call arguments as objects."""
    role = "system" if m["role"] == "developer" else m["role"]
    where = f"messages[{index}].content"
    out: dict[str, Any] = {"role": role, "content": message_text(m.get("content"), where, images, image_text)}
    if m.get("name"):
        out["name"] = m["name"]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            fn = call["function"]
            try:
                args: Any = json.loads(fn["arguments"])
            except ValueError:
                args = fn["arguments"]  # not JSON: the template gets the text as it came
            calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    return out


def message_text(content: Any, where: str, images: list[ChatImage] | None = None, image_text: str | None = None) -> str:
    """A message's content as text: a string, or a list of parts (joined). With `image_text` (a
    vision-language model) an image_url part is appended to `images` and written as image_text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") == "image_url" and image_text is not None and images is not None:
            images.append(image_part(part, f"{where}[{j}]"))
            parts.append(image_text)
            continue
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ChatError(f"{where}[{j}]: only text parts are supported"
                            + (" (this model reads no images)" if part.get("type") == "image_url" else ""), where)
        parts.append(part["text"])
    return "".join(parts)


def image_part(part: dict[str, Any], where: str) -> ChatImage:
    """An image_url part's image: a data: URL (base64, png or jpeg). Remote URLs are refused by name."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise ChatError(f"{where}.image_url.url: required (a data:image/png;base64,… URL)", where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme != "data":
        raise ChatError(f"{where}.image_url.url: {scheme or 'this'} URLs are not fetched (this server makes no "
                        "outbound requests); send the image inline as a data:image/png;base64,… URL", where)
    header, sep, payload = url[5:].partition(",")
    fields = header.split(";")
    media = fields[0].strip().lower()
    if not sep or "base64" not in (f.strip().lower() for f in fields[1:]):
        raise ChatError(f"{where}.image_url.url: a data URL must be base64 (data:image/png;base64,…)", where)
    if media not in IMAGE_MEDIA_TYPES:
        raise ChatError(f"{where}.image_url.url: media type {media or '(none)'!r} is not supported "
                        f"(image/png, image/jpeg)", where)
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{where}.image_url.url: the data URL's payload is not valid base64", where) from None
    return ChatImage(data, IMAGE_MEDIA_TYPES[media])


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of generated text. Text whose tool-call blocks do not all parse as
    `{"name": str, "arguments": object}` is returned whole, as content, with no calls."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _TOOL_CALL.finditer(text, start):
        try:
            obj = json.loads(block.group(1))
        except ValueError:
            return text, []
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict | str):
            return text, []
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(f"call_{secrets.token_hex(12)}", obj["name"], arguments))
    content = text[:start]
    return (content if content.strip() else None), calls


def forced_call_format(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The `response_format` that makes the reply one tool call in the Hermes format: a call of the
    function `name`, or of any of `tools` (`tool_choice: "required"`), whose arguments follow the
    function's parameters schema (a function without one takes no arguments: `{}`)."""
    calls = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": fn["name"]},
                                     "arguments": fn.get("parameters") or {"type": "object", "maxProperties": 0}}})
    if not calls:
        raise ChatError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema},
            "prefix": TOOL_CALL_OPEN + "\n", "suffix": "\n" + TOOL_CALL_CLOSE}


class ToolCallGate:
    """Streams content until a tool call begins; after that, holds everything for parse_tool_calls."""

    def __init__(self) -> None:
        self.text = ""
        self._sent = 0
        self.open = False  # a tool-call block has begun

    def push(self, delta: str) -> str:
        self.text += delta
        if self.open:
            return ""
        at = self.text.find(TOOL_CALL_OPEN, self._sent)
        if at >= 0:
            self.open = True
            end = at
        else:  # hold back a tail that may be the start of the marker
            end = len(self.text)
            for n in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text) - self._sent), 0, -1):
                if self.text.endswith(TOOL_CALL_OPEN[:n]):
                    end -= n
                    break
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet streamed, tool calls) at the end of the sequence."""
        content, calls = parse_tool_calls(self.text)
        if calls:
            return "", calls
        rest = self.text[self._sent :]  # no calls after all: what was held is plain content
        self._sent = len(self.text)
        return rest, []
