"""The bounds the server enforces, stated in the served OpenAPI spec.

The request models FastAPI and pydantic turn into schemas do not carry every rule the handlers
check: the JSON parse's int64 and depth limits (api/http/jsonsafe.py), the shape of ids, names and
checkpoint paths (api/tinker/paths.py, catalog/refs.py, api/state/runs.py), enums kept as plain
strings in code (scopes, audit event types), and fields the tinker package's own types declare
looser than this server takes them. `state_bounds(spec)` writes each of those rules into the spec
from the constant the check itself uses (never a restated number), so that a client generated from
the spec, or a fuzzer generating schema-valid requests (benchmarks/schema_fuzz.py,
tests/service/test_schemathesis.py), sends nothing the server then refuses for a reason the schema
could have said.

What a schema cannot say is left to the handlers and named in schema_fuzz's STATEFUL_REFUSALS:
cross-field equalities (as many coefficients as source paths, a tensor's data as long as its shape),
the content of an uploaded archive, ids the server issues (cursors), and what depends on state.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from mint_server.api.admin.service import AUDIT_TYPES
from mint_server.api.anthropic.service import _IGNORED_BLOCKS, _TOOL_CHOICE
from mint_server.api.auth.keys import SCOPES
from mint_server.api.catalog.evals import MAX_EXAMPLES, TARGET_KEYS
from mint_server.api.http.jsonsafe import INT64_MAX, INT64_MIN
from mint_server.api.state.runs import PROJECT_ID
from mint_server.api.tinker.codec import MAX_TENSOR_RANK
from mint_server.api.tinker.paths import KINDS, NAME, RUN_ID, SCHEMES
from mint_server.catalog.fields import (
    MAX_LORA_ALPHA,
    MAX_LORA_RANK,
    MAX_MODULE_NAME,
    MAX_TARGET_MODULES,
    MAX_TARGET_PATTERN,
)
from mint_server.catalog.keys import MAX_KEY_NAME
from mint_server.catalog.refs import _DIGITS_RE, _HEX_RE, ALIAS_NAME_RE, POLICY_NAME_RE
from mint_server.engine.interface import EngineLimits

# How deep a free-form value (metadata, metrics, a dataset row) is described: deeper than any such
# field needs, and well inside jsonsafe.MAX_DEPTH for the body around it.
FREE_FORM_DEPTH = 2


def _bare(pattern: re.Pattern[str]) -> str:
    """A Python pattern without its anchors, to compose into a larger one."""
    return pattern.pattern.removeprefix("^").removesuffix("$")


def _whole(body: str) -> str:
    return f"^(?:{body})$"


_HEX = _bare(_HEX_RE)
_POLICY = _bare(POLICY_NAME_RE)
_ALIAS = f"(?!{_HEX}$){_bare(ALIAS_NAME_RE)}"  # an all-hex selector would be read as a sha prefix
_CHECKPOINT_NAME = f"(?![^/]*\\.\\.){_bare(NAME)}"  # paths.check_name also refuses '..'
_SCHEME = "|".join(re.escape(s) for s in SCHEMES)
_KIND = "|".join(KINDS)
# NAME, NAME@N (N >= 1), NAME@<sha prefix>, NAME@sha256:<hex>, NAME@ALIAS (catalog/refs.parse_ref)
_NUMBER = f"(?!0+$){_bare(_DIGITS_RE)}"  # revision numbers start at 1; a number ends the reference
_SELECTOR = f"{_NUMBER}|sha256:{_HEX}|{_HEX}|{_ALIAS}"
_REF = f"{_POLICY}(?:@(?:{_SELECTOR}))?"
_CHECKPOINT_PATH = f"(?:{_SCHEME}){_bare(RUN_ID)}/(?:{_KIND})/{_CHECKPOINT_NAME}"
_POLICY_PATH = f"(?:{_SCHEME}){_POLICY}@(?:{_SELECTOR})"
_SAMPLER_PATH = f"(?:{_SCHEME}){_bare(RUN_ID)}/sampler_weights/{_CHECKPOINT_NAME}"

INT64 = {"minimum": INT64_MIN, "maximum": INT64_MAX}
PROJECT = {"type": "string", "pattern": PROJECT_ID.pattern}
CHECKPOINT_PATH = {"type": "string", "pattern": _whole(_CHECKPOINT_PATH)}
REF = {"type": "string", "pattern": _whole(_REF)}

# admin.service.usage_events: an hour boundary in UTC (a whole-hour offset keeps it one)
# Every real date: days 29-30 in months that have them, 31 in the long months, 02-29 in leap years.
_DATE = (r"(?:[0-9]{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
         r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)")
HOUR = {"type": "string", "pattern": "^(?!0000)" + _DATE + "T(?:[01][0-9]|2[0-3]):00:00(?:Z|[+-](?:0[0-9]|1[0-4]):00)$"}

# Anthropic content blocks (api/anthropic/service._messages): other fields of a block are ignored
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_IMAGE_BLOCK = {"type": "object", "required": ["type", "source"], "properties": {"type": {"const": "image"}, "source": {
    "type": "object", "required": ["type", "media_type", "data"], "properties": {
        "type": {"const": "base64"}, "media_type": {"type": "string"}, "data": {"type": "string"}}}}}
_TOOL_USE_BLOCK = {"type": "object", "required": ["type", "id", "name"], "properties": {
    "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
    "input": {"type": "object", "additionalProperties": True}}}
_TOOL_RESULT_BLOCK = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}, {"type": "null"}]}}}
_IGNORED_BLOCK = {"type": "object", "required": ["type"], "properties": {"type": {"enum": list(_IGNORED_BLOCKS)}}}
_THINKING = {"anyOf": [{"type": "object", "required": ["type"], "properties": {"type": {"const": "disabled"}}},
                       {"type": "null"}]}
_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": list(_TOOL_CHOICE)}}},
    {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "tool"}, "name": {"type": "string"}}},
    {"type": "null"},
]}  # fmt: skip

# Path and query parameters, by name (and, where one name means two things, the path it sits in).
PARAMETERS: list[tuple[str, str, dict[str, Any]]] = [  # (name, path substring, schema)
    ("run_id", "/training_runs/", {"type": "string", "pattern": RUN_ID.pattern}),
    ("kind", "/external_weights_urls", {"type": "string", "enum": ["external_weights"]}),
    ("kind", "/checkpoints/", {"type": "string", "enum": list(KINDS)}),
    ("name", "/checkpoints/{kind}/", {"type": "string", "pattern": _whole(_CHECKPOINT_NAME)}),
    ("name", "/catalog/policies/", {"type": "string", "pattern": _whole(_POLICY)}),
    ("alias", "/aliases/", {"type": "string", "pattern": _whole(_ALIAS)}),
    ("ref", "/catalog/revisions/", REF),
    ("project_id", "", PROJECT),
    ("event_type", "/audit", {"type": "string", "enum": list(AUDIT_TYPES)}),
    ("starting_on", "/billing/", HOUR),
    ("ending_before", "/billing/", HOUR),
    ("day", "/audit", {"type": "string", "format": "date"}),
    ("cursor", "", {"type": "string", "pattern": "^[A-Za-z0-9_-]*$"}),  # cursors.encode: urlsafe base64
]

# Body properties, by component and property name. A value replaces the property's schema (a
# nullable property stays nullable: see _keep_null).
PROPERTIES: dict[tuple[str, str], dict[str, Any]] = {
    ("CreateSessionRequest", "project_id"): PROJECT,
    ("CopyWeightsRequest", "destination_project_id"): PROJECT,
    ("ProjectBody", "project_id"): PROJECT,
    ("SessionSearchRequest", "project_ids"): {"type": "array", "items": PROJECT},
    ("CopyWeightsRequest", "source_path"): CHECKPOINT_PATH,
    # this server takes no access tokens (api/tinker/checkpoints.py): only null, or leave it out
    ("CopyWeightsRequest", "weights_access_token"): {"type": "null"},
    ("WeightsInfoBody", "tinker_path"): CHECKPOINT_PATH,
    ("LoadWeightsRequest", "path"): CHECKPOINT_PATH,
    ("InterpolateCheckpointsRequest", "source_paths"): {"type": "array", "items": CHECKPOINT_PATH, "minItems": 1},
    ("CreateKeyBody", "scopes"): {"type": "array", "items": {"type": "string", "enum": list(SCOPES)}, "minItems": 1},
    ("ToolParam", "type"): {"const": "custom"},  # Anthropic's server tools are refused by name
    # a number, or what follows '@' in a reference (catalog/refs.parse_ref)
    ("SetAliasBody", "revision"): {"anyOf": [{"type": "integer", "minimum": 1, "maximum": INT64_MAX},
                                             {"type": "string", "pattern": _whole(_SELECTOR)}]},
    # catalog/fields.check_lora_config
    ("CreatePolicyBody", "lora_config"): {"type": "object", "additionalProperties": False, "properties": {
        "rank": {"type": "integer", "minimum": 1, "maximum": MAX_LORA_RANK},
        "alpha": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_LORA_ALPHA},
        "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "target_modules": {"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": MAX_TARGET_PATTERN},
            {"type": "array", "maxItems": MAX_TARGET_MODULES,
             "items": {"type": "string", "minLength": 1, "maxLength": MAX_MODULE_NAME}}]},
        "train_mlp": {"type": "boolean"}, "train_attn": {"type": "boolean"}, "train_unembed": {"type": "boolean"}}},
    # api/openai/requests.admit_completion: no suffix (best_of is taken only equal to n: see schema_fuzz)
    ("CompletionRequest", "suffix"): {"type": "null"},
    # rollouts.pause refuses continue_on_new by name (partial rollouts are not supported)
    ("PauseRequest", "in_flight"): {"type": "string", "enum": ["finish_on_pinned"]},
    ("CreatePolicyBody", "name"): {"type": "string", "pattern": _whole(_POLICY)},
    ("EvalBody", "metric"): {"type": "string", "minLength": 1},
    ("CreateKeyBody", "name"): {"type": "string", "pattern": f"^[ -~]{{1,{MAX_KEY_NAME}}}$"},  # printable
    ("EvalRequest", "revisions"): {"type": "array", "items": REF, "minItems": 1, "maxItems": 32},
    ("EvalRequest", "dataset"): {"type": "array", "minItems": 1, "maxItems": MAX_EXAMPLES, "items": {
        "type": "object", "required": ["prompt"], "additionalProperties": True,
        "properties": {"prompt": {"type": "string", "minLength": 1},
                       **{k: {"type": "string", "minLength": 1} for k in TARGET_KEYS}},
        "anyOf": [{"required": [k]} for k in TARGET_KEYS]}},
    # the OpenAI faces' prompt holds at least one token (engine/preparer.py)
    ("CompletionRequest", "prompt"): {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": {"type": "integer", **INT64}},
        {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {"type": "integer", **INT64}}},
    ]},
    # Anthropic's blocks as api/anthropic/service.py reads them, by role
    ("MessagesRequest", "messages"): {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"const": "user"}, "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                "anyOf": [_TEXT_BLOCK, _IMAGE_BLOCK, _TOOL_RESULT_BLOCK]}}]}}},
        {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"const": "assistant"}, "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                "anyOf": [_TEXT_BLOCK, _TOOL_USE_BLOCK, _IGNORED_BLOCK]}}]}}},
    ]}},
    ("MessagesRequest", "system"): {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    ("MessagesRequest", "thinking"): _THINKING,
    ("MessagesRequest", "tool_choice"): _TOOL_CHOICE_SCHEMA,
}  # fmt: skip

for _prop in ("messages", "system", "thinking", "tool_choice"):
    PROPERTIES["CountTokensRequest", _prop] = PROPERTIES["MessagesRequest", _prop]

# Required fields the handler asks for that the wire type leaves optional.
REQUIRED: dict[str, list[str]] = {
    "MintSampleRequest": ["sampling_session_id"],
}

# Either-or fields: the body must hold every field of one of these sets (JSON Schema `anyOf` of
# `required`); those fields are stated non-null in PROPERTIES, so that holding one means giving it.
ONE_OF_SETS: dict[str, list[list[str]]] = {
    # load_weights into an existing model, or into a new one of a session (api/tinker/training.py)
    "LoadWeightsRequest": [["model_id"], ["session_id", "model_seq_id"]],
}


# A tool_choice needs tools to choose from (api/openai/requests.render_chat)
TOOLS_FOR_TOOL_CHOICE = ("ChatRequest", "MessagesRequest", "CountTokensRequest")

# A field that needs others beside it (JSON Schema `dependentSchemas`)
DEPENDENT_REQUIRED: dict[str, dict[str, tuple[str, ...]]] = {
    "LoadWeightsRequest": {"session_id": ("model_seq_id",)},  # api/tinker/training: a new model's seq id
}

# Exactly one of these fields (JSON Schema `oneOf` of `required`; each stated non-null in NON_NULL)
EXACTLY_ONE: dict[str, list[str]] = {
    # api/tinker/rollouts.RolloutTarget: a policy or a sampling session, never both
    component: ["policy", "sampling_session_id"] for component in ("RolloutTarget", "PauseRequest", "AbortRequest")
}

# Fields given only as a value, never as null (each in ONE_OF_SETS, EXACTLY_ONE or REQUIRED: given
# means chosen); the model's own bounds on the value are kept.
NON_NULL: dict[tuple[str, str], dict[str, Any]] = {
    **{(component, "policy"): {"type": "string", "pattern": _whole(_POLICY)} for component in EXACTLY_ONE},
    **{(component, "sampling_session_id"): {"type": "string", "minLength": 1} for component in EXACTLY_ONE},
    ("MintSampleRequest", "sampling_session_id"): {"type": "string", "minLength": 1},  # see REQUIRED
    ("LoadWeightsRequest", "model_id"): {"type": "string", "minLength": 1},
    ("LoadWeightsRequest", "session_id"): {"type": "string", "minLength": 1},
    ("LoadWeightsRequest", "model_seq_id"): {"type": "integer"},
}


def tensor(*, dtype_default: str | None = None, scalar_data: bool = False) -> dict[str, Any]:
    """A request tensor as codec.check_tensor takes it: int64 data holds integers; a shape has at
    most MAX_TENSOR_RANK dimensions, none negative; sparse CSR (both index lists given, or neither)
    needs a 2-D shape. (That the data fills the shape, and the CSR lists' lengths and order, relate
    values to each other: no JSON Schema states them.)"""
    dim = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
    index = {"type": "array", "items": dim}
    variants = []
    for dtype, value in (("int64", {"type": "integer", **INT64}), ("float32", {"type": "number", **INT64})):
        data: dict[str, Any] = {"type": "array", "items": value}
        if scalar_data:
            data = {"anyOf": [data, value]}
        required = ["data"] if dtype == dtype_default else ["data", "dtype"]
        dense = {"type": "object", "required": required, "additionalProperties": False, "properties": {
            "data": data, "dtype": {"const": dtype},
            "shape": {"anyOf": [{"type": "array", "maxItems": MAX_TENSOR_RANK, "items": dim}, {"type": "null"}]},
            "sparse_crow_indices": {"type": "null"}, "sparse_col_indices": {"type": "null"}}}  # fmt: skip
        sparse = {"type": "object", "required": [*required, "shape", "sparse_crow_indices", "sparse_col_indices"],
                  "additionalProperties": False, "properties": {
            "data": {"type": "array", "items": value}, "dtype": {"const": dtype},
            "shape": {"type": "array", "minItems": 2, "maxItems": 2, "items": dim},
            "sparse_crow_indices": index, "sparse_col_indices": index}}  # fmt: skip
        variants += [dense, sparse]
    return {"anyOf": variants}


# Components replaced whole: the tinker package's TensorData, and the extensions' WireTensor
COMPONENTS: dict[str, dict[str, Any]] = {
    "TensorData": tensor(),
    "WireTensor": tensor(dtype_default="float32", scalar_data=True),
}


def json_value(depth: int = FREE_FORM_DEPTH) -> dict[str, Any]:
    """A free-form JSON value as the JSON parse takes it: integers within int64, finite numbers,
    nested `depth` levels at most."""
    scalars: list[dict[str, Any]] = [
        {"type": "null"}, {"type": "boolean"}, {"type": "string"}, {"type": "integer", **INT64},
        {"type": "number", **INT64},
    ]  # fmt: skip
    if depth == 0:
        return {"anyOf": scalars}
    inner = json_value(depth - 1)
    return {"anyOf": [*scalars, {"type": "array", "items": inner}, {"type": "object", "additionalProperties": inner}]}


def _subschemas(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("properties", "patternProperties", "$defs"):
        yield from (s for s in schema.get(key, {}).values() if isinstance(s, dict))
    for key in ("items", "additionalProperties", "not", "contains"):
        if isinstance(schema.get(key), dict):
            yield schema[key]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        yield from (s for s in schema.get(key, []) if isinstance(s, dict))


def _free_form(schema: dict[str, Any]) -> bool:
    """A schema that admits any value: `{}` (save for annotations)."""
    return not (set(schema) - {"title", "description", "default", "examples"})


def _bound_values(schema: dict[str, Any]) -> None:
    """Every integer and number within int64 (jsonsafe refuses bigger integers anywhere in a body;
    a number bound keeps a generator from writing a big integer where a float is meant); any free-
    form value described as one the JSON parse takes; an object with declared properties takes no
    others unless it says so."""
    stack = [schema]
    while stack:
        s = stack.pop()
        types_ = s.get("type")
        types_ = types_ if isinstance(types_, list) else [types_]
        if "integer" in types_ or "number" in types_:
            s.setdefault("minimum", INT64_MIN)
            s.setdefault("maximum", INT64_MAX)
        if s.get("additionalProperties") is True or (
            isinstance(s.get("additionalProperties"), dict) and _free_form(s["additionalProperties"])
        ):
            s["additionalProperties"] = json_value()
        elif "properties" in s and "additionalProperties" not in s:
            s["additionalProperties"] = False
        elif "object" in types_ and "additionalProperties" not in s:  # a bare object: free-form
            s["additionalProperties"] = json_value()
        for key in ("items",):
            if isinstance(s.get(key), dict) and _free_form(s[key]):
                s[key] = json_value()
        for name, prop in list(s.get("properties", {}).items()):
            if isinstance(prop, dict) and _free_form(prop):
                s["properties"][name] = {**prop, **json_value()}
        stack.extend(_subschemas(s))


def _keep_null(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`, still allowing null where `old` did (an optional field may be sent as null)."""
    nullable = any(branch.get("type") == "null" for branch in old.get("anyOf", [])) or old.get("type") == "null"
    annotations = {k: old[k] for k in ("title", "description", "default") if k in old}
    if nullable and new.get("type") != "null":
        return {**annotations, "anyOf": [new, {"type": "null"}]}
    return {**annotations, **new}


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, operations in spec.get("paths", {}).items():
        for op in operations.values():
            if isinstance(op, dict):
                yield path, op


def _engine_bounds(limits: EngineLimits) -> dict[tuple[str, str], dict[str, Any]]:
    """What the engine's limits (EngineLimits: every engine-side check reads them) bound, by field."""
    stop_text = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    stops = {"type": "array", "items": stop_text, "maxItems": limits.max_stop_sequences}
    token = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    tokens = {"type": "integer", "minimum": 1, "maximum": limits.max_context}
    samples = {"type": "integer", "minimum": 1, "maximum": limits.max_num_samples}
    bounds: dict[tuple[str, str], dict[str, Any]] = {
        ("MessagesRequest", "stop_sequences"): stops,
        ("MintSamplingParams", "stop"): {"anyOf": [stop_text, stops, {**stops, "items": token}]},
        ("MintSamplingParams", "max_tokens"): tokens,
        ("MintSampleRequest", "num_samples"): samples,
        ("MessagesRequest", "max_tokens"): tokens,
        ("EvalRequest", "max_tokens"): tokens,
    }
    for component in ("ChatRequest", "CompletionRequest"):
        bounds[component, "stop"] = {"anyOf": [stop_text, stops]}
        if component == "CompletionRequest":  # a prompt holds at least one token, each in the vocabulary
            bounds[component, "prompt"] = {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": token},
                {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": token}},
            ]}
        bounds[component, "max_tokens"] = tokens
        bounds[component, "max_completion_tokens"] = tokens
        bounds[component, "n"] = samples
        bounds[component, "top_logprobs"] = {"type": "integer", "minimum": 0, "maximum": limits.max_top_logprobs}
    return bounds


def state_bounds(spec: dict[str, Any], served_base_models: list[str] | None = None,
                 limits: EngineLimits | None = None) -> None:
    """Write the server's bounds into `spec` (in place): see the module doc."""
    components = spec.get("components", {}).get("schemas", {})
    for component, schema in COMPONENTS.items():
        if component in components:
            annotations = {k: components[component][k] for k in ("title", "description") if k in components[component]}
            components[component] = {**annotations, **schema}
    engine_bounds = _engine_bounds(limits) if limits is not None else {}
    for (component, prop), schema in {**PROPERTIES, **engine_bounds}.items():  # the engine's are finer
        if component in components and prop in components[component].get("properties", {}):
            properties = components[component]["properties"]
            properties[prop] = _keep_null(properties[prop], schema)
    for (component, prop), schema in NON_NULL.items():
        if component in components and prop in components[component].get("properties", {}):
            properties = components[component]["properties"]
            old = properties[prop]
            given = next((b for b in old.get("anyOf", []) if b.get("type") != "null"), old)  # what the model says
            kept = {k: v for k, v in given.items() if k not in ("anyOf", "default")}
            properties[prop] = {**{k: old[k] for k in ("title", "description") if k in old}, **kept, **schema}
    for component, fields in REQUIRED.items():
        if component in components:
            required = components[component].setdefault("required", [])
            required.extend(f for f in fields if f not in required)
    for component in TOOLS_FOR_TOOL_CHOICE:
        if component in components:
            components[component]["dependentSchemas"] = {
                "tool_choice": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
    for component, needs in DEPENDENT_REQUIRED.items():
        if component in components:
            components[component]["dependentSchemas"] = {f: {"required": list(rest)} for f, rest in needs.items()}
    for component, fields in EXACTLY_ONE.items():
        if component in components:
            components[component]["oneOf"] = [{"required": [field]} for field in fields]
    for component, alternatives in ONE_OF_SETS.items():
        if component in components:
            components[component]["anyOf"] = [{"required": fields} for fields in alternatives]
    if served_base_models:
        # what the OpenAI and Anthropic faces serve (api/openai/models.resolve): the base model, a
        # catalog reference, a sampler checkpoint's path or a policy reference's path
        model = {"type": "string", "pattern": _whole("|".join(
            [*(re.escape(m) for m in served_base_models), _REF, _SAMPLER_PATH, _POLICY_PATH]))}
        for component in ("ChatRequest", "CompletionRequest", "MessagesRequest", "CountTokensRequest"):
            if "model" in components.get(component, {}).get("properties", {}):
                components[component]["properties"]["model"] = model
        for path, op in _operations(spec):
            for parameter in op.get("parameters", []):
                if parameter.get("name") == "model_id" and path.endswith("/models/{model_id}"):
                    parameter["schema"] = model
        # a policy is created for a model this server serves (api/catalog/routes.check_base_model)
        base = {"type": "string", "enum": list(served_base_models)}
        for component in ("CreatePolicyBody",):
            if "base_model" in components.get(component, {}).get("properties", {}):
                components[component]["properties"]["base_model"] = base
        for path, op in _operations(spec):
            for parameter in op.get("parameters", []):
                if parameter.get("name") == "base_model" and "/catalog/policies/" in path:
                    parameter["schema"] = _keep_null(parameter.get("schema", {}), base)
    for path, op in _operations(spec):
        for parameter in op.get("parameters", []):
            for name, where, schema in PARAMETERS:
                if parameter.get("name") == name and where in path:
                    parameter["schema"] = _keep_null(parameter.get("schema", {}), schema)
                    break
    for schema in components.values():
        _bound_values(schema)
    for _, op in _operations(spec):
        for parameter in op.get("parameters", []):
            _bound_values(parameter.get("schema", {}))
        for media in op.get("requestBody", {}).get("content", {}).values():
            _bound_values(media.get("schema", {}))
