"""Training endpoints, sampling endpoints and the mindlab-toolkit extensions.

Handlers only decode, call the service, and encode; every rule lives in the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel
from tinker import types

from mint_server.api.auth.keys import SERVE, TRAIN, Principal
from mint_server.api.http.openapi import ForwardBackwardBody, ForwardBody, body_doc
from mint_server.api.http.plumbing import decompress, json_body, needs, ordered_ids, parse, service
from mint_server.api.tinker import codec
from mint_server.api.tinker.mint_types import (
    EXTENSIONS_HEADER,
    ForwardBackwardReverseKLRequest,
    InterpolateCheckpointsRequest,
    MintSampleRequest,
)

router = APIRouter(prefix="/api/v1")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def _future(f: types.UntypedAPIFuture) -> dict[str, Any]:
    return f.model_dump(mode="json", exclude_none=True)


@router.post("/create_model", openapi_extra=body_doc(types.CreateModelRequest))
async def create_model(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    return _future(service(request).training.create_model(p, await parse(request, types.CreateModelRequest)))


@router.post("/get_info", openapi_extra=body_doc(types.GetInfoRequest))
async def get_info(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    info = service(request).training.get_info(p, await parse(request, types.GetInfoRequest))
    return info.model_dump(mode="json", exclude_none=True)


async def ordered(request: Request, p: Principal, decode: Awaitable[T]) -> T:
    """`decode` a request that takes a place in its model's seq_id order. If it is refused before
    it reaches the service, its seq_id is still given up: the client's next request must not wait
    for it forever (the SDK numbers every request and sends the next one regardless)."""
    try:
        return await decode
    except codec.DecodeError as e:
        if e.model_id is not None and e.seq_id is not None:
            service(request).training.give_up_seq(p, e.model_id, e.seq_id)
        raise


async def _parse_ordered(request: Request, p: Principal, model: type[M]) -> M:
    return await ordered(request, p, parse(request, model))


async def _fwdbwd_call(request: Request, input_field: str, forward_only: bool) -> codec.FwdBwdCall:
    """tinker 0.38 posts protobuf (maybe zstd); 0.22 posts JSON with `forward_backward_input` or `forward_input`."""
    if "application/x-protobuf" in request.headers.get("content-type", ""):
        limit = service(request).core.settings.max_body_bytes
        body = decompress(await request.body(), request.headers.get("content-encoding"), limit)
        return await asyncio.to_thread(codec.decode_fwdbwd_proto, body)
    obj = await json_body(request)
    model_id, seq_id = ordered_ids(obj)
    try:
        unknown = set(obj) - {input_field, "model_id", "seq_id", "type"}
        if unknown:
            raise codec.DecodeError(f"unknown field {sorted(unknown)[0]!r}")
        if model_id is None:
            raise codec.DecodeError("missing field 'model_id'")
        if obj.get("seq_id") is not None and seq_id is None:
            raise codec.DecodeError("invalid field 'seq_id': expected an integer")
        loss_fn, config, data = await asyncio.to_thread(codec.fwdbwd_input_from_json, obj.get(input_field), input_field)
    except codec.DecodeError as e:  # the same refusal, now naming the place in the order it gives up
        e.model_id, e.seq_id = model_id, seq_id
        raise
    return codec.FwdBwdCall(model_id, seq_id, loss_fn, config, data, forward_only)


@router.post("/forward_backward", openapi_extra=body_doc(ForwardBackwardBody, protobuf=True))
async def forward_backward(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    call = await ordered(request, p, _fwdbwd_call(request, "forward_backward_input", forward_only=False))
    return _future(service(request).training.forward_backward(p, call))


@router.post("/forward", openapi_extra=body_doc(ForwardBody, protobuf=True))
async def forward(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    call = await ordered(request, p, _fwdbwd_call(request, "forward_input", forward_only=True))
    return _future(service(request).training.forward_backward(p, call))


@router.post("/optim_step", openapi_extra=body_doc(types.OptimStepRequest))
async def optim_step(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    return _future(service(request).training.optim_step(p, await _parse_ordered(request, p, types.OptimStepRequest)))


@router.post("/save_weights", openapi_extra=body_doc(types.SaveWeightsRequest))
async def save_weights(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    return _future(service(request).training.save_weights(p, await _parse_ordered(request, p, types.SaveWeightsRequest)))


@router.post("/save_weights_for_sampler", openapi_extra=body_doc(types.SaveWeightsForSamplerRequest))
async def save_weights_for_sampler(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    req = await _parse_ordered(request, p, types.SaveWeightsForSamplerRequest)
    return _future(service(request).training.save_weights_for_sampler(p, req))


@router.post("/load_weights", openapi_extra=body_doc(types.LoadWeightsRequest))
async def load_weights(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    return _future(service(request).training.load_weights(p, await _parse_ordered(request, p, types.LoadWeightsRequest)))


@router.post("/unload_model", openapi_extra=body_doc(types.UnloadModelRequest))
async def unload_model(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    return _future(service(request).training.unload_model(p, await parse(request, types.UnloadModelRequest)))


@router.post("/create_custom_loss", openapi_extra=body_doc(types.CreateCustomLossRequest))
async def create_custom_loss(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    req = await parse(request, types.CreateCustomLossRequest)
    return _future(service(request).training.create_custom_loss(p, req))


@router.post("/save_weights_external", openapi_extra=body_doc(types.SaveWeightsExternalRequest))
async def save_weights_external(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    req = await parse(request, types.SaveWeightsExternalRequest)
    return _future(service(request).training.save_weights_external(p, req))


# --- sampling ------------------------------------------------------------------------------------
@router.post("/create_sampling_session", openapi_extra=body_doc(types.CreateSamplingSessionRequest))
async def create_sampling_session(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    req = await parse(request, types.CreateSamplingSessionRequest)
    return service(request).sampling.create_session(p, req).model_dump(mode="json")


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    return service(request).sampling.describe(p, sampler_id).model_dump(mode="json")


@router.post("/asample", openapi_extra=body_doc(MintSampleRequest))
async def asample(request: Request, p: Principal = needs(SERVE)) -> dict[str, Any]:
    # X-Mint-Priority: a rollout may lower its own scheduling class ("batch": sweeps, evals);
    # X-Mint-Sampling-Params: sampling controls from clients that cannot put them in the body (the tinker SDK)
    return _future(service(request).sampling.asample(p, await parse(request, MintSampleRequest),
                                                     priority=request.headers.get("x-mint-priority"),
                                                     extensions=request.headers.get(EXTENSIONS_HEADER)))


# --- mindlab-toolkit extensions ------------------------------------------------------------------
@router.post("/mint/forward_backward_reverse_kl", openapi_extra=body_doc(ForwardBackwardReverseKLRequest))
async def forward_backward_reverse_kl(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    req = await _parse_ordered(request, p, ForwardBackwardReverseKLRequest)
    return _future(service(request).mint.reverse_kl(p, req))


@router.post("/mint/checkpoints/interpolate", openapi_extra=body_doc(InterpolateCheckpointsRequest))
async def interpolate_checkpoints(request: Request, p: Principal = needs(TRAIN)) -> dict[str, Any]:
    req = await parse(request, InterpolateCheckpointsRequest)
    return _future(service(request).mint.interpolate(p, req))
