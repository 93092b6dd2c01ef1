"""Grammar-constrained decoding: a sample's tokens kept inside a JSON schema, a regex or a Lark grammar.

`response_format` (the same object on both faces: docs/openai.md, docs/wire-protocol.md) is parsed
here into a `Grammar`, whose text is an llguidance grammar: plain text, so a job that crosses
processes (a fleet replica) carries it as it is. The engine's `Grammars` compiles it against the
engine's tokenizer when the request is parsed (a bad schema is the request's 400, naming the
field) and keeps the compiled matcher as a template. Each sample gets a copy of it at its first
token and keeps it on its sampler row, so samples of one request advance independently, and a row
that is preempted keeps its matcher (only its KV leaves the device).

Each step, every grammar row's matcher writes the tokens it allows into one int32 bitmask row
(`masks`: [rows, ceil(V / 32)], bit t of row i = token t allowed); sampler_ops masks those rows'
logits with it before anything else shapes them, and the drawn token advances the matcher
(`advance`). A row's sequence ends ("stop") when its grammar is complete: the matcher allows only
EOS once the text is complete, and stops when EOS is drawn.

JSON is laid out as `json.dumps` does by default (", " and ": ", no other whitespace), so a model
cannot run on in whitespace; a schema's own `x-guidance` object may change that (llguidance's JSON
options). A sample cut short by max_tokens ends with "length" and its text need not parse.

llguidance, not xgrammar: measured side by side (benchmarks/grammar.py, docs/openai.md), xgrammar
0.2.9 fills masks a few µs faster per row, but lets raw control characters into JSON strings with a
maxLength (invalid JSON: 2 % of random walks of such a schema on SmolLM2's vocabulary, 47 % on a
byte-level one, fail json.loads) and pulls triton (~285 MB) into a CPU install; llguidance
compiles schemas 10-50x faster and produced no invalid JSON.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mint_server.engine.values import EngineError

log = logging.getLogger(__name__)

# The types `response_format` may name, and the keys each may carry next to "type".
FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset(),
    "json_object": frozenset({"prefix", "suffix"}),
    "json_schema": frozenset({"json_schema", "prefix", "suffix"}),
    "regex": frozenset({"regex"}),
    "lark": frozenset({"lark"}),
}
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
# llguidance's JSON options: the layout json.dumps writes by default, and no other whitespace.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEMPLATES_KEPT = 256  # compiled grammars kept for reuse (most recently used)


@dataclass(frozen=True)
class Grammar:
    """A parsed `response_format`: its type and its llguidance grammar text."""

    kind: str
    text: str


def parse_response_format(value: Any, where: str, max_chars: int) -> Grammar | None:
    """`response_format` → a Grammar (None for "text" or no value); EngineError names the field (see
    `_parse`). Whatever the library raises on a malformed input is the input's fault too."""
    try:
        return _parse(value, where, max_chars)
    except (ValueError, TypeError, RuntimeError) as e:  # RecursionError included: a schema nested too deep
        if isinstance(e, EngineError):
            raise
        raise EngineError(f"{where}: {e}") from None


def _parse(value: Any, where: str, max_chars: int) -> Grammar | None:
    """{"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name",
    "description", "schema", "strict"}} | {"type": "regex", "regex": str} | {"type": "lark", "lark": str}
    (llguidance's Lark, where `%json {...}` embeds a schema). json_object and json_schema may also
    carry "prefix" / "suffix": literal text around the JSON (tool calls: "<tool_call>\\n" … ).
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise EngineError(f"{where}: must be an object with a 'type'")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in FORMAT_KEYS:
        raise EngineError(f"{where}.type: must be one of {', '.join(FORMAT_KEYS)}, got {kind!r}")
    for key in value:
        if key != "type" and key not in FORMAT_KEYS[kind]:
            raise EngineError(f"{where}.{key}: unknown field for type {kind!r}")
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError):
        raise EngineError(f"{where}: must be plain JSON") from None
    if size > max_chars:
        raise EngineError(f"{where}: {size} characters, at most {max_chars}")
    from llguidance import LLMatcher

    if kind == "text":
        return None
    if kind in ("regex", "lark"):
        source = value.get(kind)
        if not isinstance(source, str) or not source:
            raise EngineError(f"{where}.{kind}: must be a non-empty string")
        return Grammar(kind, LLMatcher.grammar_from_regex(source) if kind == "regex" else LLMatcher.grammar_from_lark(source))
    schema: Any = {"type": "object"}  # json_object: any JSON object
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise EngineError(f"{where}.json_schema: must be an object with a 'schema'")
        for key in spec:
            if key not in JSON_SCHEMA_KEYS:
                raise EngineError(f"{where}.json_schema.{key}: unknown field")
        for key, kinds in (("name", str), ("description", str), ("strict", bool)):
            if spec.get(key) is not None and not isinstance(spec[key], kinds):
                raise EngineError(f"{where}.json_schema.{key}: must be a {kinds.__name__}")
        schema = spec.get("schema", schema)
        if not isinstance(schema, Mapping):
            raise EngineError(f"{where}.json_schema.schema: must be a JSON schema object")
    layout = schema.get("x-guidance", {})
    if not isinstance(layout, Mapping):
        raise EngineError(f"{where}: x-guidance must be an object")
    schema = {**schema, "x-guidance": {**JSON_LAYOUT, **layout}}
    prefix, suffix = value.get("prefix", ""), value.get("suffix", "")
    for key, text in (("prefix", prefix), ("suffix", suffix)):
        if not isinstance(text, str):
            raise EngineError(f"{where}.{key}: must be a string")
    if not prefix and not suffix:
        return Grammar(kind, LLMatcher.grammar_from_json_schema(dict(schema)))
    parts = [_lark_literal(prefix) if prefix else "", f"%json {json.dumps(schema)}", _lark_literal(suffix) if suffix else ""]
    return Grammar(kind, LLMatcher.grammar_from_lark("start: " + " ".join(p for p in parts if p)))


def _lark_literal(text: str) -> str:
    """`text` as a Lark string literal (a JSON string literal is one)."""
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """The engine's grammars, compiled against its tokenizer: checked when a request is parsed
    (`parse`), a matcher per sample (`start`), the step's bitmask (`masks`) and each drawn token
    (`advance`). The library's tokenizer is built on first use (~0.5 s for a 49K vocabulary).
    Thread-safe: requests are parsed on the api's threads while the sampler steps."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], max_chars: int) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.max_chars = max_chars
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, Any] = OrderedDict()  # grammar text → compiled matcher

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def _library_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids)
            return self._tokenizer

    def parse(self, value: Any, where: str) -> Grammar | None:
        """Parse and compile a `response_format` (EngineError naming the field)."""
        grammar = parse_response_format(value, where, self.max_chars)
        if grammar is not None:
            self._template(grammar, where)
        return grammar

    def _template(self, grammar: Grammar, where: str = "response_format") -> Any:
        with self._lock:
            if (template := self._templates.get(grammar.text)) is not None:
                self._templates.move_to_end(grammar.text)
                return template
        from llguidance import LLMatcher

        template = LLMatcher(self._library_tokenizer(), grammar.text, log_level=0)  # compiles without the GIL
        if template.is_error():
            raise EngineError(f"{where}: {template.get_error()}")
        template.compute_bitmask()  # its first mask, once: the samples' copies start from it warm
        if template.is_error() or (not template.is_accepting() and template.is_stopped()):
            # Compiled, but no text can start: a $ref cycle with no base case ({"$ref": "#"}) and the
            # like. Refused here, at admission, not sampled into an empty 200.
            detail = next((line for line in str(template.get_error() or "").splitlines() if line.strip()), "")
            raise EngineError(f"{where}: no text satisfies this grammar (an unsatisfiable or recursive schema"
                              + (f"; {detail[:200]}" if detail else "") + ")")
        with self._lock:
            self._templates[grammar.text] = template
            while len(self._templates) > TEMPLATES_KEPT:
                self._templates.popitem(last=False)
        return template

    def start(self, grammar: Grammar) -> Any:
        """A matcher of its own for one sample, at the start of its text."""
        return self._template(grammar).deep_copy()

    def masks(self, matchers: Sequence[Any]) -> torch.Tensor:
        """[len(matchers), words] int32 on the CPU: the tokens each matcher allows next. A matcher
        that failed (a parser limit hit: see `advance`) allows nothing."""
        from llguidance.torch import fill_next_token_bitmask

        out = torch.zeros(len(matchers), self.words, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if not m.is_error():
                fill_next_token_bitmask(m, out, i)
            if m.is_error():  # it can go no further: EOS only, and `advance` ends the sequence there
                log.warning("grammar matcher failed: %s", m.get_error())
                out[i] = 0
                for t in self.eos_token_ids:
                    out[i, t // 32] |= (1 << (t % 32) ^ 0x80000000) - 0x80000000  # bit t % 32 as a signed int32
        return out

    @staticmethod
    def advance(matcher: Any, token: int) -> bool:
        """Feed the drawn token; True when the sequence ends here (its grammar is complete, or the
        matcher failed: llguidance's per-step limits stop a pathological grammar)."""
        return not matcher.consume_token(token) or matcher.is_stopped() or matcher.is_error()
