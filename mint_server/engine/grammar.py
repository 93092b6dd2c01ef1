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


def _resolve(root: Mapping[str, Any], ref: str) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/x", "#/definitions/x/…") points to; None if it
    points elsewhere (the library reports those)."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def has_finite_instance(root: Mapping[str, Any]) -> bool:
    """Whether some finite JSON value can satisfy `root`, as far as recursion goes: a schema whose
    every instance must contain an instance of itself (`{"$ref": "#"}`, or an object that requires a
    property referring back, A requires B requires A) has none, and a grammar built from it admits
    only text that never ends. The least fixpoint over the `$ref` targets: each starts unsatisfiable
    and becomes satisfiable once one of its branches is, so a cycle with no base case stays out.
    Only recursion is judged; other contradictions (minimum above maximum, …) are the library's."""
    targets: dict[str, Any] = {"#": root}
    known: dict[str, bool] = {}

    def finite(schema: Any, depth: int = 0) -> bool:
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, Mapping) or depth > 64:
            return True  # not a schema this judges (the library checks it), or nested past caring
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref not in targets:
                targets[ref] = _resolve(root, ref)
            if not known.get(ref, False):
                return False
        if "anyOf" in schema or "oneOf" in schema:
            branches = [*schema.get("anyOf", []), *schema.get("oneOf", [])]
            if isinstance(branches, list) and branches and not any(finite(b, depth + 1) for b in branches):
                return False
        if isinstance(schema.get("allOf"), list) and not all(finite(b, depth + 1) for b in schema["allOf"]):
            return False
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if isinstance(kinds, str) else None
        if kinds is None or "object" in kinds or "array" in kinds:
            # with no type, or several, one finite kind is enough; otherwise the object or array rule
            scalar = kinds is None and not ({"properties", "required", "items", "minItems"} & set(schema)) or (
                kinds is not None and any(k not in ("object", "array") for k in kinds))
            object_ok = array_ok = False
            if kinds is None or "object" in kinds:
                properties = schema.get("properties", {}) if isinstance(schema.get("properties"), Mapping) else {}
                extra = schema.get("additionalProperties", True)
                required = schema.get("required", []) if isinstance(schema.get("required"), list) else []
                object_ok = all(finite(properties.get(name, extra), depth + 1) for name in required)
            if kinds is None or "array" in kinds:
                items = schema.get("items", True)
                min_items = schema.get("minItems", 0)
                prefix = schema.get("prefixItems", []) if isinstance(schema.get("prefixItems"), list) else []
                array_ok = all(finite(p, depth + 1) for p in prefix[: min_items if isinstance(min_items, int) else 0])
                if isinstance(min_items, int) and min_items > len(prefix):
                    array_ok = array_ok and finite(items, depth + 1)
            if not (scalar or object_ok or array_ok):
                return False
        return True

    changed = True
    while changed:  # until nothing turns satisfiable and no new target turns up
        changed, seen = False, len(targets)
        for ref, target in list(targets.items()):
            if not known.get(ref, False) and target is not None and finite(target):
                known[ref] = changed = True
            elif target is None and not known.get(ref, False):
                known[ref] = changed = True  # a reference this does not follow is the library's to judge
        changed = changed or len(targets) > seen
    return known.get("#", False) and finite(root)


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
        if not has_finite_instance(schema):
            raise EngineError(f"{where}.json_schema.schema: no text satisfies this schema (an unsatisfiable or "
                              "recursive schema: every value it admits holds itself, through required "
                              "properties, minItems or allOf, so none is finite)")
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
