"""A JSON schema that no finite value satisfies (issue 52, item 4) is refused when the response_format
is parsed, naming `response_format.json_schema.schema`: a grammar built from it admits only text that
never ends, so sampling it would run to max_tokens and answer a 200 with a truncated, invalid value.
Recursion with a base case is still accepted."""

from __future__ import annotations

from typing import Any

import pytest

from mint_server.engine.grammar import has_finite_instance, parse_response_format
from mint_server.engine.interface import EngineError


def obj(required: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": required, "required": list(required)}


NONE_FINITE = {
    "self-ref": {"$ref": "#"},
    "defs-cycle": {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"},
    "requires-itself": obj({"a": {"$ref": "#"}}),
    "A-requires-B-requires-A": {"$defs": {"A": obj({"b": {"$ref": "#/$defs/B"}}), "B": obj({"a": {"$ref": "#/$defs/A"}})},
                                "$ref": "#/$defs/A"},
    "non-empty-array-of-itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "allOf-itself": {"allOf": [{"$ref": "#"}]},
    "every-branch-recurses": {"anyOf": [obj({"a": {"$ref": "#"}}), {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]},
}
FINITE = {
    "plain": obj({"x": {"type": "string"}}),
    "optional-self": {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "nullable-link": {"$defs": {"A": obj({"b": {"$ref": "#/$defs/B"}}),
                                "B": {"anyOf": [{"type": "null"}, obj({"a": {"$ref": "#/$defs/A"}})]}}, "$ref": "#/$defs/A"},
    "tree": {"$defs": {"node": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
             "$ref": "#/$defs/node"},
    "object-or-null": {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "empty": {},
}


@pytest.mark.parametrize("schema", list(NONE_FINITE.values()), ids=list(NONE_FINITE))
def test_a_schema_no_finite_value_satisfies_is_refused_naming_the_field(schema: dict[str, Any]) -> None:
    assert not has_finite_instance(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}
    with pytest.raises(EngineError, match=r"^response_format\.json_schema\.schema: no text satisfies"):
        parse_response_format(fmt, "response_format", 65536)


@pytest.mark.parametrize("schema", list(FINITE.values()), ids=list(FINITE))
def test_recursion_with_a_base_case_is_accepted(schema: dict[str, Any]) -> None:
    assert has_finite_instance(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    assert parse_response_format(fmt, "response_format", 65536) is not None
