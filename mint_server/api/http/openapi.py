"""The served OpenAPI spec (`/openapi.json`, `/docs`): request schemas for every route.

Most Tinker routes read their body themselves (one checked JSON parse, see jsonsafe; protobuf for
tinker 0.38's forward_backward), so FastAPI cannot see a body parameter. `body_doc(Model)` declares
the body for the docs only, from the wire types the handler validates against; `install` puts the
models those schemas refer to into the spec's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, create_model
from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput as WireFwdBwdInput

from mint_server.api.http.spec_bounds import state_bounds
from mint_server.engine.interface import EngineLimits

REF = "#/components/schemas/{model}"
_COMPONENTS: dict[str, Any] = {}


def body_doc(model: type[BaseModel], *, protobuf: bool = False, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route whose handler reads a `model`-shaped JSON body itself."""
    schema = model.model_json_schema(ref_template=REF)
    _COMPONENTS.update(schema.pop("$defs", {}))
    _COMPONENTS[model.__name__] = schema
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}
    if protobuf:  # tinker 0.38 sends a ForwardBackwardRequest protobuf, maybe zstd-compressed
        content["application/x-protobuf"] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": required, "content": content}}


def _fwdbwd_body(name: str, input_field: str) -> type[BaseModel]:
    """The JSON (tinker 0.22) shape of forward / forward_backward, built from the SDK's own input type."""
    fields: dict[str, Any] = {"model_id": (str, ...), "seq_id": (int | None, None), input_field: (WireFwdBwdInput, ...)}
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


ForwardBackwardBody = _fwdbwd_body("ForwardBackwardBody", "forward_backward_input")
ForwardBody = _fwdbwd_body("ForwardBody", "forward_input")


class WeightsInfoBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tinker_path: str


class TtlBody(BaseModel):
    ttl_seconds: int | None = None


class ProjectBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # admin.service.assign_project refuses other fields
    project_id: str


class CancelFutureBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # the handler refuses other fields
    request_id: str


# What any route may answer besides its success, and why (api/http/plumbing.py's STATUS_OF and the body
# limits apply to every route). Routes that take no credential (no `security` entry) never answer
# 401 or 403.
ERROR_STATUSES = {
    "400": "Bad input: the message (`detail`) names the field",
    "401": "Missing, unknown or revoked API key",
    "403": "The key lacks the scope this route needs (its `security` entry names it)",
    "404": "Not found (also anything that belongs to another key)",
    "408": "The request body stalled",
    "409": "Already exists",
    "410": "The session has ended",
    "413": "Request body too large",
    "429": "Too much work in flight for this key; retry after `Retry-After`",
    "431": "Request headers too large",
    "500": "Stored data failed its integrity check (the message names the blob)",
    "503": "The server is shutting down; retry after `Retry-After`",
    "507": "Not enough disk space for what the request writes; nothing partial was kept",
}
ERROR_SCHEMA = {"type": "object", "properties": {"detail": {"type": "string"}}}


def _document_errors(spec: dict[str, Any]) -> None:
    """Every status a route can return is in its `responses`; FastAPI's 422 is not (we answer 400)."""
    for operations in spec.get("paths", {}).values():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status, why in ERROR_STATUSES.items():
                if status in ("401", "403") and not op.get("security"):
                    continue
                responses.setdefault(status, {"description": why,
                                              "content": {"application/json": {"schema": ERROR_SCHEMA}}})


def install(app: FastAPI, served_base_models: list[str] | None = None, limits: EngineLimits | None = None) -> None:
    """Serve the spec: the routes' schemas, the body models of `body_doc`, every error status, and
    the server's bounds (spec_bounds; `served_base_models` are the models the faces serve, `limits` the engine's)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in _COMPONENTS.items():
                components.setdefault(name, schema)
            _document_errors(spec)
            state_bounds(spec, served_base_models, limits)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
