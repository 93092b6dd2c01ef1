"""Wire encodings ↔ tinker types, both directions, for the two request/response kinds that travel as
protobuf (forward_backward, sampling results). The message classes come from `tinker.proto`; the
SDK ships only the client half of each conversion, so the server half is written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types._pydantic_types.datum import (
    _key_to_type as PLAIN_LIST_DTYPES,  # the SDK's name → dtype table
)
from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput as WireFwdBwdInput
from tinker.types._pydantic_types.tensor_data import TensorData as WireTensorData

_NP_OF_DTYPE = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}
_PROTO_OF_DTYPE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_DTYPE_OF_PROTO = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64"}
_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class DecodeError(ValueError):
    """A body we cannot turn into a request; the message names the field.

    `model_id` and `seq_id` are set when the body got far enough to name them: a refused ordered
    request still gives up its seq_id, or the client's next request would wait for it forever.
    """

    def __init__(self, message: str, *, model_id: str | None = None, seq_id: int | None = None) -> None:
        super().__init__(message)
        self.model_id = model_id
        self.seq_id = seq_id


@dataclass(frozen=True)
class FwdBwdCall:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    data: list[types.Datum]
    forward_only: bool


# --- tensor checks -------------------------------------------------------------------------------
# Every tensor of a request passes `check_tensor` where it is decoded, before torch or numpy
# reshapes, densifies or casts it: a bad one is a 400 naming the field and the rule it breaks,
# never a RuntimeError from torch. The bounds are far above any loss input the engine takes
# ([n] or [n, K] with n within the model's context).
MAX_TENSOR_RANK = 4
MAX_TENSOR_ELEMENTS = 1 << 25  # dense size, so a sparse tensor cannot ask to be densified into gigabytes
_INT64_MAX = 2**63


def _invalid(where: str, rule: str) -> DecodeError:
    return DecodeError(f"invalid field {where!r}: {rule}")


def _int_array(values: Any, where: str) -> np.ndarray:
    try:
        arr = np.asarray(values if values is not None else [], dtype=np.int64)
    except (ValueError, OverflowError, TypeError):
        raise _invalid(where, "must be a list of integers within int64") from None
    if arr.ndim != 1:
        raise _invalid(where, "must be a flat list of integers")
    return arr


def _check_values(data: Any, dtype: str, where: str) -> int:
    """The number of values; int64 tensors must hold integers (33.5 is refused, not truncated)."""
    try:
        arr = np.asarray(data)
    except (ValueError, OverflowError, TypeError):
        raise _invalid(where + ".data", "must be a flat list of numbers") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        if arr.size == 0:
            return 0
        raise _invalid(where + ".data", "must be a flat list of numbers")
    if dtype == "int64" and arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            bad = arr[~(np.isfinite(arr) & (arr == np.floor(np.where(np.isfinite(arr), arr, 0))))][0]
            raise _invalid(where + ".data", f"dtype int64 holds integers only, got {float(bad)!r}")
        if arr.size and np.max(np.abs(arr)) >= _INT64_MAX:
            raise _invalid(where + ".data", "a value is outside the int64 range")
    elif dtype == "float32" and arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise _invalid(where + ".data", "contains NaN or inf")
    return int(arr.size)


def check_tensor(t: Any, where: str) -> None:
    """A tensor's shape, dtype, values and (when sparse) CSR layout, before anything uses it.

    Dense: shape (when given) has at most MAX_TENSOR_RANK dims, none negative, and holds exactly
    len(data) values. Sparse CSR (`sparse_crow_indices` + `sparse_col_indices`): a 2-D shape
    [rows, cols]; rows + 1 row pointers starting at 0, never decreasing, ending at len(data) ==
    len(col_indices); column indices in [0, cols) and strictly increasing within each row.
    Either way the dense size is at most MAX_TENSOR_ELEMENTS, and int64 values are integers.
    """
    dtype = getattr(t, "dtype", None)
    if dtype not in _NP_OF_DTYPE:
        raise _invalid(where + ".dtype", f"must be 'float32' or 'int64', got {dtype!r}")
    n = _check_values(t.data, dtype, where)
    shape = t.shape
    size = n
    if shape is not None:
        if len(shape) > MAX_TENSOR_RANK:
            raise _invalid(where + ".shape", f"at most {MAX_TENSOR_RANK} dimensions, got {len(shape)}")
        if any(not isinstance(d, int | np.integer) or d < 0 for d in shape):
            raise _invalid(where + ".shape", f"dimensions must be integers >= 0, got {list(shape)}")
        size = math.prod(int(d) for d in shape)
    if size > MAX_TENSOR_ELEMENTS:
        raise _invalid(where + ".shape", f"{size} elements exceed the limit of {MAX_TENSOR_ELEMENTS}")
    # getattr: a wire type without the CSR fields (the mindlab-toolkit extensions' WireTensor) is dense
    crow_given = getattr(t, "sparse_crow_indices", None) is not None
    col_given = getattr(t, "sparse_col_indices", None) is not None
    if not (crow_given or col_given):
        if shape is not None and size != n:
            raise _invalid(where + ".shape", f"{list(shape)} holds {size} values but data has {n}")
        return
    if not (crow_given and col_given):
        raise _invalid(where, "sparse_crow_indices and sparse_col_indices must be given together (sparse CSR)")
    if shape is None or len(shape) != 2:
        raise _invalid(where + ".shape", f"a sparse CSR tensor needs a 2-D shape [rows, cols], got {shape!r}")
    rows, cols = int(shape[0]), int(shape[1])
    crow = _int_array(t.sparse_crow_indices, where + ".sparse_crow_indices")
    col = _int_array(t.sparse_col_indices, where + ".sparse_col_indices")
    if crow.size != rows + 1:
        raise _invalid(where + ".sparse_crow_indices", f"must hold rows + 1 = {rows + 1} row pointers, got {crow.size}")
    if crow[0] != 0:
        raise _invalid(where + ".sparse_crow_indices", f"must start at 0, got {int(crow[0])}")
    if rows and (drops := np.flatnonzero(np.diff(crow) < 0)).size:
        i = int(drops[0])
        raise _invalid(where + ".sparse_crow_indices", f"row pointers must not decrease ({int(crow[i])} then "
                                                        f"{int(crow[i + 1])} at index {i + 1})")
    if col.size != n:
        raise _invalid(where + ".sparse_col_indices", f"must hold one column per value ({n}), got {col.size}")
    if crow[-1] != n:
        raise _invalid(where + ".sparse_crow_indices", f"the last row pointer must equal the number of values "
                                                        f"({n}), got {int(crow[-1])}")
    if n and ((col < 0) | (col >= cols)).any():
        bad = int(col[(col < 0) | (col >= cols)][0])
        raise _invalid(where + ".sparse_col_indices", f"column {bad} is outside the row width [0, {cols})")
    if n > 1:
        increasing = np.diff(col) > 0
        starts = crow[1:-1]
        increasing[starts[(starts > 0) & (starts < n)] - 1] = True  # a new row may start at any column
        if not increasing.all():
            raise _invalid(where + ".sparse_col_indices", "columns must be strictly increasing within each row")


# --- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RawTensor:
    """A tensor's fields as they came, for `check_tensor` before any type reshapes or casts them."""

    data: Any
    dtype: str
    shape: list[int] | None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


def _tensor_from_proto(msg: pb.Tensor, where: str) -> types.TensorData:
    dtype = _DTYPE_OF_PROTO.get(msg.dtype)
    if dtype is None:
        raise DecodeError(f"{where}: unsupported tensor dtype {msg.dtype}")
    np_dtype = _NP_OF_DTYPE[dtype]
    shape = list(msg.shape) or None
    try:
        if msg.HasField("sparse_csr"):
            csr = msg.sparse_csr
            raw = _RawTensor(np.frombuffer(csr.values, dtype=np_dtype).copy(), dtype, shape,
                             np.frombuffer(csr.crow_indices, dtype=np.int64).tolist(),
                             np.frombuffer(csr.col_indices, dtype=np.int64).tolist())
        else:
            raw = _RawTensor(np.frombuffer(msg.dense, dtype=np_dtype).copy(), dtype, shape)
    except (ValueError, OverflowError, TypeError) as e:  # byte count not a multiple of the itemsize
        raise DecodeError(f"{where}: {e}") from None
    check_tensor(raw, where)
    try:
        return types.TensorData(data=raw.data, dtype=dtype, shape=shape, sparse_crow_indices=raw.sparse_crow_indices,
                                sparse_col_indices=raw.sparse_col_indices)
    except (ValueError, OverflowError, TypeError) as e:
        raise DecodeError(f"{where}: {e}") from None


def _datum_from_proto(msg: pb.Datum, i: int) -> types.Datum:
    chunks: list[types.ModelInputChunk] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind == "image":
            chunks.append(_image_from_proto(chunk.image, f"data[{i}].model_input.chunks[{j}]"))
            continue
        if kind != "encoded_text":
            raise DecodeError(f"data[{i}].model_input.chunks[{j}]: {kind!r} chunks are not supported "
                              "(encoded_text and image are)")
        tokens = chunk.encoded_text.tokens
        if len(tokens) % 4:
            raise DecodeError(f"data[{i}].model_input: token bytes are not int32")
        chunks.append(types.EncodedTextChunk(tokens=np.frombuffer(tokens, dtype=np.int32).tolist()))
    inputs = {k: _tensor_from_proto(v, f"data[{i}].loss_fn_inputs.{k}") for k, v in msg.loss_fn_inputs.items()}
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs,
        model_input_spans=_spans_from_proto(msg.model_input_spans, f"data[{i}].model_input_spans"),
        loss_fn_input_spans=_spans_from_proto(msg.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans"),
    )


def _image_from_proto(msg: pb.ImageChunk, where: str) -> types.ImageChunk:
    """An image chunk's bytes as sent (the engine decodes them: the api never reads pixels)."""
    if msg.HasField("override_dimensions"):
        raise DecodeError(f"{where}.override_dimensions is not supported (the image's own size is used)")
    try:
        return types.ImageChunk(data=msg.data, format=msg.format,  # type: ignore[arg-type]
                                expected_tokens=msg.expected_tokens if msg.HasField("expected_tokens") else None)
    except ValidationError as e:
        raise DecodeError(describe_validation_error(e, prefix=where)) from None


def _spans_from_proto(spans: Any, where: str) -> types.ProvenanceSpans | None:
    """Provenance runs (sampled / prompt tokens of recorded sequences); None when the datum has none."""
    if not spans:
        return None
    out: types.ProvenanceSpans = []
    for j, span in enumerate(spans):
        arm = span.WhichOneof("span")
        if arm is None:
            raise DecodeError(f"{where}[{j}]: empty provenance span")
        m = getattr(span, arm)
        cls = types.SampledProvenanceSpan if arm == "sampled_tokens" else types.PromptProvenanceSpan
        try:
            out.append(cls(sequence_id=m.sequence_id, offset=m.offset, length=m.length))
        except ValueError as e:
            raise DecodeError(f"{where}[{j}]: {e}") from None
    return out


def decode_fwdbwd_proto(body: bytes) -> FwdBwdCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf raises its own DecodeError type
        raise DecodeError(f"body is not a ForwardBackwardRequest protobuf: {e}") from None
    if not msg.model_id:
        raise DecodeError("missing field 'model_id'")
    # proto3 has no "unset" for ints: the SDK always sends seq_id >= 1, so 0 means missing.
    seq_id = msg.seq_id or None
    try:
        config: dict[str, float | str] = dict(msg.loss_fn_config.items())
        for k, v in msg.loss_fn_config_v2.items():  # v2 carries strings too and wins when present
            config[k] = v.text if v.WhichOneof("value") == "text" else v.number
        for k, v in config.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise DecodeError(f"invalid field 'loss_fn_config.{k}': must be finite")
        data = [_datum_from_proto(d, i) for i, d in enumerate(msg.data)]
    except DecodeError as e:  # the same refusal, now naming the place in the order it gives up
        e.model_id, e.seq_id = msg.model_id, seq_id
        raise
    return FwdBwdCall(
        model_id=msg.model_id,
        seq_id=seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config or None,
        data=data,
        forward_only=msg.forward_only,
    )


def public_tensor(t: WireTensorData, where: str = "tensor") -> types.TensorData:
    check_tensor(t, where)
    try:
        return types.TensorData(
            data=t.data,
            dtype=t.dtype,
            shape=t.shape,
            sparse_crow_indices=t.sparse_crow_indices,
            sparse_col_indices=t.sparse_col_indices,
        )
    except (ValueError, OverflowError, TypeError) as e:  # e.g. a shape no array can have
        raise DecodeError(f"{where}: {e}") from None


def fwdbwd_input_from_json(obj: Any, field: str) -> tuple[str, dict[str, float | str] | None, list[types.Datum]]:
    """`forward_backward_input` / `forward_input` of a 0.22 JSON request."""
    if not isinstance(obj, dict):
        raise DecodeError(f"missing field {field!r}")
    _check_plain_lists(obj, field)
    try:
        wire = WireFwdBwdInput.model_validate(obj)
    except ValidationError as e:
        raise DecodeError(describe_validation_error(e, prefix=field)) from None
    except (ValueError, TypeError, KeyError) as e:  # raised by the SDK's own converters: still the input's fault
        raise DecodeError(f"invalid field {field + '.data'!r}: {e}") from None
    data = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: public_tensor(v, f"{field}.data[{i}].loss_fn_inputs.{k}") for k, v in d.loss_fn_inputs.items()},
        )
        for i, d in enumerate(wire.data)
    ]
    return wire.loss_fn, dict(wire.loss_fn_config) if wire.loss_fn_config else None, data


def _check_plain_lists(obj: dict[str, Any], field: str) -> None:
    """A loss input sent as a plain list takes its dtype from its name (the SDK's table), so only
    names in that table may be plain lists; any other needs {"data", "dtype"}."""
    data = obj.get("data")
    if not isinstance(data, list):
        return
    for i, d in enumerate(data):
        inputs = d.get("loss_fn_inputs") if isinstance(d, dict) else None
        if not isinstance(inputs, dict):
            continue
        for k, v in inputs.items():
            if isinstance(v, list) and k not in PLAIN_LIST_DTYPES:
                raise DecodeError(
                    f"invalid field '{field}.data[{i}].loss_fn_inputs.{k}': a plain list is only accepted for "
                    f"{sorted(PLAIN_LIST_DTYPES)}; send {{\"data\": [...], \"dtype\": \"float32\"|\"int64\"}}")
            if isinstance(v, list) and PLAIN_LIST_DTYPES.get(k) == "int64":
                # The SDK casts a plain list to its dtype (33.5 would become 33): check the values first.
                try:
                    flat = np.asarray(v, dtype=np.float64).ravel()
                except (ValueError, TypeError, OverflowError):
                    continue  # ragged or not numeric: the SDK's own conversion refuses it
                _check_values(flat, "int64", f"{field}.data[{i}].loss_fn_inputs.{k}")


def describe_validation_error(e: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming its field, e.g. "missing field 'model_id'"."""
    lines = []
    for err in e.errors()[:5]:
        loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        if err["type"] == "missing":
            lines.append(f"missing field {loc!r}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"unknown field {loc!r}")
        else:
            lines.append(f"invalid field {loc!r}: {err['msg']}")
    return "; ".join(lines) or "invalid request body"


# --- responses -----------------------------------------------------------------------------------
def _dense(t: types.TensorData) -> np.ndarray:
    return np.asarray(t.to_numpy(), dtype=_NP_OF_DTYPE[t.dtype])


def encode_fwdbwd_output(out: types.ForwardBackwardOutput) -> bytes:
    """One ArrayRecord per run of datums whose fields agree on dtype and trailing shape."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for k, v in out.metrics.items():
        msg.metrics[k] = float(v)
    arrays = [{k: _dense(t) for k, t in d.items()} for d in out.loss_fn_outputs]

    def layout(d: dict[str, np.ndarray]) -> tuple:
        return tuple(sorted((k, a.dtype.str, a.shape[1:]) for k, a in d.items()))

    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and layout(arrays[end]) == layout(arrays[start]):
            end += 1
        record = msg.loss_fn_outputs.add(num_datums=end - start)
        for name, arr in arrays[start].items():
            parts = [np.ascontiguousarray(d[name]) for d in arrays[start:end]]
            offsets = np.cumsum([0] + [p.nbytes for p in parts], dtype=np.int64)
            bt = record.fields[name]
            bt.data = b"".join(p.tobytes() for p in parts)
            bt.offsets = offsets.tobytes()
            bt.dtype = _PROTO_OF_DTYPE["float32" if arr.dtype == np.float32 else "int64"]
            bt.trailing_shape.extend(arr.shape[1:])
        start = end
    return msg.SerializeToString()


def _topk_proto(topk: types.TopkLogprobs, target: pb.TopkLogprobs) -> None:
    n, k = topk.token_ids.shape
    target.token_ids = np.ascontiguousarray(topk.token_ids, dtype=np.int32).tobytes()
    target.logprobs = np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes()
    target.k = k
    target.length = n


def encode_prompt_extras(resp: types.SampleResponse, msg: Any) -> None:
    """Write a SampleResponse's target_prompt_logprobs and prompt_alt_tokens into its proto message
    (tinker_public_pb2.SampleResponse, fields 5 and 6; tinker.proto.response_conv reads them back,
    keeping a CSR tensor sparse). For encode_sample_response."""
    if resp.target_prompt_logprobs is not None:
        _tensor_proto(resp.target_prompt_logprobs, msg.target_prompt_logprobs)
    if resp.prompt_alt_tokens is not None:
        _tensor_proto(resp.prompt_alt_tokens.tokens, msg.prompt_alt_tokens.tokens)
        _tensor_proto(resp.prompt_alt_tokens.logprobs, msg.prompt_alt_tokens.logprobs)


def _tensor_proto(t: types.TensorData, out: Any) -> None:
    dtype = np.float32 if t.dtype == "float32" else np.int64
    out.dtype = pb.DTYPE_FLOAT32 if t.dtype == "float32" else pb.DTYPE_INT64
    out.shape.extend(t.shape or [])
    values = np.ascontiguousarray(t.to_numpy() if t.sparse_crow_indices is None else np.asarray(t.data), dtype=dtype)
    if t.sparse_crow_indices is None:
        out.dense = values.tobytes()
    else:
        out.sparse_csr.values = values.tobytes()
        out.sparse_csr.crow_indices = np.asarray(t.sparse_crow_indices, dtype=np.int64).tobytes()
        out.sparse_csr.col_indices = np.asarray(t.sparse_col_indices, dtype=np.int64).tobytes()


def _logprob_array(values: list[float | None] | None) -> np.ndarray | None:
    if values is None:
        return None
    return np.asarray([math.nan if v is None else v for v in values], dtype=np.float32)


def encode_sample_response(resp: types.SampleResponse) -> bytes:
    msg = pb.SampleResponse(prompt_cache_hit_tokens=resp.prompt_cache_hit_tokens)
    for seq in resp.sequences:
        out = msg.sequences.add(stop_reason=_STOP_REASON[seq.stop_reason])
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs_np is not None:
            _topk_proto(seq.topk_logprobs_np, out.topk_sampled_logprobs)
    prompt = resp.prompt_logprobs_np if resp.prompt_logprobs_np is not None else _logprob_array(resp.prompt_logprobs)
    if prompt is not None:
        msg.prompt_logprobs = np.asarray(prompt, dtype=np.float32).tobytes()
    if resp.topk_prompt_logprobs_np is not None:
        _topk_proto(resp.topk_prompt_logprobs_np, msg.topk_prompt_logprobs)
    encode_prompt_extras(resp, msg)  # target_prompt_logprobs, prompt_alt_tokens (fields 5, 6)
    return msg.SerializeToString()


def tensor_json(t: types.TensorData) -> dict[str, Any]:
    arr = _dense(t)
    return {"data": arr.ravel().tolist(), "dtype": t.dtype, "shape": list(arr.shape)}


def fwdbwd_output_json(out: types.ForwardBackwardOutput) -> dict[str, Any]:
    return {
        "loss_fn_output_type": out.loss_fn_output_type,
        "loss_fn_outputs": [{k: tensor_json(t) for k, t in d.items()} for d in out.loss_fn_outputs],
        "metrics": dict(out.metrics),
    }


def sample_response_json(resp: types.SampleResponse) -> dict[str, Any]:
    return {
        "type": "sample",
        "sequences": [
            {"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": s.logprobs} for s in resp.sequences
        ],
        "prompt_logprobs": resp.prompt_logprobs,
        **({"target_prompt_logprobs": _wire_tensor_json(resp.target_prompt_logprobs)}
           if resp.target_prompt_logprobs is not None else {}),
        **({"prompt_alt_tokens": {"tokens": _wire_tensor_json(resp.prompt_alt_tokens.tokens),
                                  "logprobs": _wire_tensor_json(resp.prompt_alt_tokens.logprobs)}}
           if resp.prompt_alt_tokens is not None else {}),
    }


def _wire_tensor_json(t: types.TensorData) -> dict[str, Any]:
    """A response tensor as the request's TensorData JSON: a sparse CSR one stays sparse."""
    if t.sparse_crow_indices is None:
        return tensor_json(t)
    return {"data": np.asarray(t.data).tolist(), "dtype": t.dtype, "shape": list(t.shape or []),
            "sparse_crow_indices": list(t.sparse_crow_indices), "sparse_col_indices": list(t.sparse_col_indices or [])}
