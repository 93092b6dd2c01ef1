"""Bad input over every route: a table of hostile but realistic requests (Tinker, MinT extensions,
catalog REST, HTTP limits). Each one must be answered with the expected 4xx whose message names the
field at fault; afterwards the server still serves and nothing it holds has changed. Ordered
requests the server refuses still give up their seq_id (the last test proves the model's next
request runs).

One server and one HTTP client for the whole table (cheap: each case is a few loopback requests on
a kept-alive connection), and one state snapshot per case: the state after a case is the state
before the next.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from mint_server.api import CATALOG_PREFIX
from mint_server.api.auth.keys import owner_id
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, tiny_engine, train

BIG = 2**70  # beyond int64
SURROGATE = "\ud800"
NUL_SURROGATE_KEY = "bad\udfffkey"


@dataclass
class Ctx:
    """What the cases refer to: things that exist on the server before the table runs."""

    server: LiveServer
    session_id: str
    model_id: str
    sampler_id: str
    weights_path: str
    sampler_path: str
    policy: str
    next_seq: int = 1
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60))
    state: dict[str, Any] | None = None  # the last snapshot taken, which no case may change

    def seq(self) -> int:
        """A fresh seq_id for the model: every ordered case the server refuses must give it up."""
        self.next_seq += 1
        return self.next_seq - 1


def unused(c: Ctx, body: dict[str, Any], **over: Any) -> dict[str, Any]:
    """`body` with its seq_id taken back (the case cannot consume it: other key, no usable ids)."""
    c.next_seq -= 1
    return {**body, **over}


def undecodable(c: Ctx, body: bytes) -> bytes:
    """`body`, whose seq_id the server cannot read (it does not decode): the case gives it back."""
    c.next_seq -= 1
    return body


Body = Any  # dict/list (sent as JSON), str (sent as raw JSON text), bytes (raw), or a function of Ctx


@dataclass
class Case:
    id: str
    method: str
    path: str  # relative to /api/v1; "{model}", "{sampler}", "{session}", "{policy}" are filled in
    body: Body = None
    status: int = 400
    names: str = ""  # must appear in the error message: the field (or thing) at fault
    headers: dict[str, str] = field(default_factory=dict)
    key: str | None = KEY_A


def _fill(value: Any, ctx: Ctx) -> Any:
    if callable(value):
        return value(ctx)
    if isinstance(value, str):
        return value.format(model=ctx.model_id, sampler=ctx.sampler_id, session=ctx.session_id, policy=ctx.policy)
    return value


def tokens(ids: list[int]) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": ids}]}


def fb(ctx: Ctx, **over: Any) -> dict[str, Any]:
    """A JSON (tinker 0.22 style) forward_backward body with one fresh seq_id; `over` replaces parts."""
    datum = {
        "model_input": over.pop("model_input", tokens([1, 2, 3])),
        "loss_fn_inputs": over.pop("loss_fn_inputs", {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}}),
    }
    fb_input = {"data": over.pop("data", [datum]), "loss_fn": over.pop("loss_fn", "cross_entropy")}
    if "loss_fn_config" in over:
        fb_input["loss_fn_config"] = over.pop("loss_fn_config")
    return {"model_id": ctx.model_id, "seq_id": ctx.seq(), "forward_backward_input": fb_input, **over}


def fb_text(ctx: Ctx, fragment: str) -> str:
    """A forward_backward body as JSON text with `fragment` as the weights tensor's data (NaN etc.)."""
    body = fb(ctx, loss_fn_inputs={"target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
                                   "weights": {"data": "@@", "dtype": "float32"}})  # fmt: skip
    return json.dumps(body).replace('"@@"', fragment)


def proto_fb(ctx: Ctx, chunk: pb.Chunk | None = None, tensor: pb.Tensor | None = None, **over: Any) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=ctx.model_id, seq_id=ctx.seq(), loss_fn="cross_entropy", **over)
    datum = msg.data.add()
    datum.model_input.append(chunk or pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=b"\x01\0\0\0\x02\0\0\0")))
    target = tensor or pb.Tensor(dense=(2).to_bytes(8, "little") * 2, dtype=pb.DTYPE_INT64, shape=[2])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(target)
    return msg.SerializeToString()


PROTO = {"content-type": "application/x-protobuf"}


def optim(ctx: Ctx, **adam: Any) -> dict[str, Any]:
    return {"model_id": ctx.model_id, "seq_id": ctx.seq(), "optim_params": {"learning_rate": 0.01, **adam}}


def sample(ctx: Ctx, params: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    return {
        "sampling_session_id": ctx.sampler_id, "seq_id": 1, "num_samples": 1, "prompt": tokens([1, 2, 3]),
        "sampling_params": {"max_tokens": 4, **(params or {})}, **over,
    }  # fmt: skip


def create_model(ctx: Ctx, lora: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    return {"session_id": ctx.session_id, "model_seq_id": 900, "base_model": BASE,
            "lora_config": {"rank": 2, **(lora or {})}, **over}  # fmt: skip


def session(**over: Any) -> dict[str, Any]:
    return {"tags": [], "user_metadata": None, "sdk_version": "t", **over}


def rkl(ctx: Ctx, **over: Any) -> dict[str, Any]:
    datum = {"student_input": tokens([1, 2, 3]), "reference_input": tokens([1, 2, 3]),
             "target_tokens": {"data": [2, 3, 4], "dtype": "int64"}, "weights": {"data": [1.0, 1.0, 1.0]}}  # fmt: skip
    datum.update(over.pop("datum", {}))
    return {"model_id": ctx.model_id, "reference_model_path": BASE, "data": [datum], "temperature": 1.0,
            "seq_id": ctx.seq(), **over}  # fmt: skip


def cursor(tag: str, key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps([tag, key]).encode()).decode().rstrip("=")


def deep(n: int) -> str:
    return "[" * n + "]" * n


CAT = CATALOG_PREFIX.removeprefix("/api/v1/")
M = "{model}"
CKPT = "training_runs/{model}/checkpoints"

CASES: list[Case] = [
    # --- bodies in general ----------------------------------------------------------------------
    Case("not-json", "POST", "create_session", b"{not json", names="not valid JSON"),
    Case("json-array", "POST", "create_session", [1, 2], names="JSON object"),
    Case("deep-nesting", "POST", "create_session", deep(100_000), names="nested"),
    Case("deep-nesting-64", "POST", "create_session", '{"user_metadata": {"a": ' + deep(64) + '}}', names="user_metadata.a"),
    Case("nan-literal", "POST", "create_session", '{"tags": [], "sdk_version": "t", "user_metadata": {"x": NaN}}', names="NaN"),
    Case("infinity-literal", "POST", "create_session", '{"tags": [], "sdk_version": "t", "user_metadata": {"x": -Infinity}}', names="Infinity"),
    Case("overflow-float", "POST", "create_session", '{"tags": [], "sdk_version": "t", "user_metadata": {"x": 1e400}}', names="user_metadata.x"),
    Case("bigint-metadata", "POST", "create_session", session(user_metadata={"x": BIG}), names="user_metadata.x"),
    Case("surrogate-metadata", "POST", "create_session", json.dumps(session(user_metadata={"x": SURROGATE})), names="user_metadata.x"),
    Case("surrogate-key", "POST", "create_session", json.dumps(session(user_metadata={NUL_SURROGATE_KEY: 1})), names="user_metadata key"),
    Case("surrogate-display-name", "POST", "create_session", json.dumps(session(display_name=SURROGATE)), names="display_name"),
    Case("surrogate-tag", "POST", "create_session", json.dumps(session(tags=["ok", "a" + SURROGATE])), names="tags[1]"),
    Case("session-missing-fields", "POST", "create_session", {}, names="tags"),
    Case("session-unknown-field", "POST", "create_session", session(nope=1), names="nope"),
    Case("session-metadata-huge", "POST", "create_session", session(user_metadata={"x": "a" * (1 << 20)}), names="user_metadata"),
    Case("session-finish-other", "POST", "sessions/{session}/finish", {"reason": {"type": "success"}}, status=404,
         names="session", key=KEY_B),
    Case("session-finish-unknown", "POST", "sessions/" + "f" * 32 + "/finish", {"reason": {"type": "success"}}, status=404,
         names="session"),
    Case("invalid-utf8-body", "POST", "create_session", b'{"tags": [], "sdk_version": "\xff\xfe"}', names="JSON"),
    # --- auth -----------------------------------------------------------------------------------
    Case("no-key", "GET", "training_runs", status=401, names="X-API-Key", key=None),
    Case("unknown-key", "POST", "create_session", session(), status=401, names="unknown API key", key="tml-nope-0000"),
    Case("bad-jwt", "GET", "checkpoints", status=401, names="", key="eyJhbGciOi.bad.token"),
    Case("no-key-catalog", "GET", CAT + "/policies", status=401, names="X-API-Key", key=None),
    Case("no-key-train", "POST", "optim_step", {"model_id": "x", "optim_params": {}}, status=401, names="X-API-Key", key=None),
    # --- client bootstrap, sessions, futures --------------------------------------------------
    Case("config-surrogate", "POST", "client/config", json.dumps({"sdk_version": SURROGATE}), names="sdk_version"),
    Case("config-missing", "POST", "client/config", {}, names="sdk_version"),
    Case("heartbeat-missing", "POST", "session_heartbeat", {}, names="session_id"),
    Case("heartbeat-unknown", "POST", "session_heartbeat", {"session_id": "f" * 32}, status=410, names="session"),
    Case("heartbeat-int", "POST", "session_heartbeat", {"session_id": 7}, names="session_id"),
    Case("future-unknown", "POST", "retrieve_future", {"request_id": "nope"}, status=404, names="request"),
    Case("future-missing", "POST", "retrieve_future", {}, names="request_id"),
    Case("future-surrogate", "POST", "retrieve_future", json.dumps({"request_id": SURROGATE}), names="request_id"),
    Case("session-view-unknown", "GET", "sessions/" + "f" * 32, status=404, names="session"),
    Case("sessions-limit-0", "GET", "sessions?limit=0", names="limit"),
    Case("sessions-offset-neg", "GET", "sessions?offset=-1", names="offset"),
    Case("sessions-offset-big", "GET", f"sessions?offset={BIG}", names="offset"),
    # --- create_model ---------------------------------------------------------------------------
    Case("create-unknown-session", "POST", "create_model", lambda c: create_model(c, session_id="f" * 32), status=404, names="session"),
    Case("create-wrong-base", "POST", "create_model", lambda c: create_model(c, base_model="other/model"), names="base_model"),
    Case("create-no-lora", "POST", "create_model", lambda c: create_model(c, lora_config=None), names="lora_config"),
    Case("create-rank-0", "POST", "create_model", lambda c: create_model(c, {"rank": 0}), names="rank"),
    Case("create-rank-big", "POST", "create_model", lambda c: create_model(c, {"rank": BIG}), names="lora_config.rank"),
    Case("create-rank-str", "POST", "create_model", lambda c: create_model(c, {"rank": "four"}), names="rank"),
    Case("create-seed-big", "POST", "create_model", lambda c: create_model(c, {"seed": BIG}), names="lora_config.seed"),
    Case("create-nothing-trained", "POST", "create_model",
         lambda c: create_model(c, {"train_mlp": False, "train_attn": False, "train_unembed": False}), names="train_mlp"),
    Case("create-seq-big", "POST", "create_model", lambda c: create_model(c, model_seq_id=BIG), names="model_seq_id"),
    Case("create-seq-neg", "POST", "create_model", lambda c: create_model(c, model_seq_id=-1), names="model_seq_id"),
    Case("create-policy-name", "POST", "create_model", lambda c: create_model(c, user_metadata={"policy": "no spaces"}), names="policy"),
    Case("create-policy-int", "POST", "create_model", lambda c: create_model(c, user_metadata={"policy": 3}), names="policy"),
    Case("create-metadata-surrogate", "POST", "create_model",
         lambda c: json.dumps(create_model(c, user_metadata={"note": SURROGATE})), names="user_metadata.note"),
    Case("create-metadata-huge", "POST", "create_model", lambda c: create_model(c, user_metadata={"x": "a" * (1 << 20)}),
         names="user_metadata"),
    Case("create-optimizer", "POST", "create_model", lambda c: create_model(c, optimizer_config={"type": "sgd"}), names="optimizer_config"),
    Case("create-unknown-field", "POST", "create_model", lambda c: create_model(c, extra=1), names="extra"),
    Case("get-info-unknown", "POST", "get_info", {"model_id": "f" * 32 + ":train:0"}, status=404, names="model_id"),
    Case("get-info-missing", "POST", "get_info", {}, names="model_id"),
    # --- forward_backward / forward as JSON ------------------------------------------------------
    Case("fb-token-bigint", "POST", "forward_backward", lambda c: fb(c, model_input=tokens([1, BIG, 3])), names="tokens[1]"),
    Case("fb-token-negative", "POST", "forward_backward", lambda c: fb(c, model_input=tokens([1, -5, 3])), names="-5"),
    Case("fb-token-vocab", "POST", "forward_backward", lambda c: fb(c, model_input=tokens([1, 10**9, 3])), names="vocabulary"),
    Case("fb-target-bigint", "POST", "forward_backward",
         lambda c: fb(c, loss_fn_inputs={"target_tokens": {"data": [2, BIG, 4], "dtype": "int64"}}), names="target_tokens"),
    Case("fb-weights-nan", "POST", "forward_backward", lambda c: fb_text(c, "[1.0, NaN, 1.0]"), names="NaN"),
    Case("fb-weights-inf", "POST", "forward_backward", lambda c: fb_text(c, "[1.0, 1e999, 1.0]"), names="weights"),
    Case("fb-length-mismatch", "POST", "forward_backward",
         lambda c: fb(c, loss_fn_inputs={"target_tokens": {"data": [2, 3], "dtype": "int64"}}), names="target_tokens"),
    Case("fb-unknown-loss", "POST", "forward_backward", lambda c: fb(c, loss_fn="nope"), names="loss_fn"),
    Case("fb-config-key", "POST", "forward_backward", lambda c: fb(c, loss_fn_config={"beta": 1.0}), names="beta"),
    Case("fb-config-clip-negative", "POST", "forward_backward",
         lambda c: fb(c, loss_fn="ppo", loss_fn_inputs={"target_tokens": {"data": [2, 3, 4], "dtype": "int64"},
                                                        "logprobs": {"data": [-1.0] * 3, "dtype": "float32"},
                                                        "advantages": {"data": [1.0] * 3, "dtype": "float32"}},
                      loss_fn_config={"clip_low_threshold": -0.5}), names="clip_low_threshold"),
    Case("fb-unknown-input-list", "POST", "forward_backward",
         lambda c: fb(c, loss_fn_inputs={"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}, "x": [1]}), names="loss_fn_inputs.x"),
    Case("fwd-unknown-input-list-no-model", "POST", "forward",
         {"model_id": "nope", "seq_id": 1, "forward_input": {"loss_fn": "cross_entropy", "data": [
             {"model_input": tokens([1, 2]), "loss_fn_inputs": {"x": [1]}}]}}, names="loss_fn_inputs.x"),
    Case("fb-image-chunk", "POST", "forward_backward",
         lambda c: fb(c, model_input={"chunks": [{"type": "image", "data": "aGk=", "format": "png", "expected_tokens": 3}]}),
         names="model_input"),
    Case("fb-unknown-field", "POST", "forward_backward", lambda c: fb(c, extra=1), names="extra"),
    Case("fb-no-model", "POST", "forward_backward", {"seq_id": 1, "forward_backward_input": {"data": [], "loss_fn": "cross_entropy"}}, names="model_id"),
    Case("fb-seq-str", "POST", "forward_backward", lambda c: unused(c, fb(c), seq_id="1"), names="seq_id"),
    Case("fb-seq-bool", "POST", "forward_backward", lambda c: unused(c, fb(c), seq_id=True), names="seq_id"),
    Case("fb-seq-big", "POST", "forward_backward", lambda c: unused(c, fb(c), seq_id=BIG), names="seq_id"),
    Case("fb-seq-negative", "POST", "forward_backward", lambda c: unused(c, fb(c), seq_id=-1), names="seq_id"),
    Case("fb-data-not-list", "POST", "forward_backward", lambda c: fb(c, data={"a": 1}), names="data"),
    Case("fb-missing-input", "POST", "forward_backward", lambda c: {"model_id": c.model_id, "seq_id": c.seq()}, names="forward_backward_input"),
    Case("fb-other-owner", "POST", "forward_backward", lambda c: unused(c, fb(c)), status=404, names="model_id", key=KEY_B),
    Case("fwd-bad-dtype", "POST", "forward",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "forward_input": {"loss_fn": "cross_entropy", "data": [
             {"model_input": tokens([1, 2]), "loss_fn_inputs": {"target_tokens": {"data": [1, 2], "dtype": "int8"}}}]}},
         names="dtype"),
    Case("fwd-token-bigint", "POST", "forward",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "forward_input": {"loss_fn": "cross_entropy", "data": [
             {"model_input": tokens([BIG]), "loss_fn_inputs": {"target_tokens": {"data": [1], "dtype": "int64"}}}]}},
         names="tokens[0]"),
    # --- forward_backward as protobuf (tinker 0.38) --------------------------------------------
    Case("proto-garbage", "POST", "forward_backward", b"\xff\xff\xff\xff garbage", names="ForwardBackwardRequest", headers=PROTO),
    Case("proto-image-chunk", "POST", "forward_backward",
         lambda c: proto_fb(c, chunk=pb.Chunk(image=pb.ImageChunk(data=b"\x89PNG", format="png"))), names="model_input", headers=PROTO),
    Case("proto-odd-token-bytes", "POST", "forward_backward",
         lambda c: proto_fb(c, chunk=pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=b"\x01\0\0"))), names="model_input", headers=PROTO),
    Case("proto-bad-dtype", "POST", "forward_backward",
         lambda c: proto_fb(c, tensor=pb.Tensor(dense=b"\0" * 8, dtype=99)), names="loss_fn_inputs", headers=PROTO),
    Case("proto-bad-shape", "POST", "forward_backward",
         lambda c: proto_fb(c, tensor=pb.Tensor(dense=b"\0" * 8, dtype=pb.DTYPE_INT64, shape=[5])), names="target_tokens", headers=PROTO),
    Case("proto-vocab", "POST", "forward_backward",
         lambda c: proto_fb(c, chunk=pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=(10**9).to_bytes(4, "little") * 2))),
         names="vocabulary", headers=PROTO),
    Case("proto-no-model", "POST", "forward_backward", pb.ForwardBackwardRequest(seq_id=3).SerializeToString(), names="model_id", headers=PROTO),
    Case("proto-bad-zstd", "POST", "forward_backward", b"not zstd", names="zstd", headers={**PROTO, "content-encoding": "zstd"}),
    Case("proto-truncated-zstd", "POST", "forward_backward",
         lambda c: undecodable(c, zstandard.ZstdCompressor().compress(proto_fb(c))[:-4]), names="truncated",
         headers={**PROTO, "content-encoding": "zstd"}),
    Case("json-truncated-zstd", "POST", "forward_backward",
         lambda c: undecodable(c, zstandard.ZstdCompressor().compress(json.dumps(fb(c)).encode())[:-4]), names="truncated",
         headers={"content-type": "application/json", "content-encoding": "zstd"}),
    Case("proto-gzip", "POST", "forward_backward", b"x", names="Content-Encoding", headers={**PROTO, "content-encoding": "gzip"}),
    Case("proto-zstd-image", "POST", "forward_backward",
         lambda c: zstandard.ZstdCompressor().compress(proto_fb(c, chunk=pb.Chunk(image=pb.ImageChunk(data=b"x", format="png")))),
         names="model_input", headers={**PROTO, "content-encoding": "zstd"}),
    # --- optim_step -----------------------------------------------------------------------------
    Case("optim-missing", "POST", "optim_step", lambda c: {"model_id": c.model_id, "seq_id": c.seq()}, names="optim_params"),
    Case("optim-nan", "POST", "optim_step", lambda c: json.dumps(optim(c)).replace("0.01", "NaN"), names="NaN"),
    Case("optim-lr-inf", "POST", "optim_step", lambda c: json.dumps(optim(c)).replace("0.01", "1e999"), names="learning_rate"),
    Case("optim-lr-negative", "POST", "optim_step", lambda c: optim(c, learning_rate=-1.0), names="learning_rate"),
    Case("optim-beta1", "POST", "optim_step", lambda c: optim(c, beta1=1.0), names="beta1"),
    Case("optim-clip-negative", "POST", "optim_step", lambda c: optim(c, grad_clip_norm=-1.0), names="grad_clip_norm"),
    Case("optim-lr-bigint", "POST", "optim_step", lambda c: optim(c, learning_rate=BIG), names="learning_rate"),
    Case("optim-unknown-param", "POST", "optim_step", lambda c: optim(c, momentum=0.9), names="momentum"),
    Case("optim-lr-huge", "POST", "optim_step", lambda c: optim(c, learning_rate=1e30), names="learning_rate"),
    Case("optim-decay-flips", "POST", "optim_step", lambda c: optim(c, learning_rate=1.0, weight_decay=2.0), names="weight_decay"),
    Case("optim-eps-huge", "POST", "optim_step", lambda c: optim(c, eps=1e30), names="eps"),
    Case("optim-unknown-model", "POST", "optim_step",
         {"model_id": "f" * 32 + ":train:7", "seq_id": 1, "optim_params": {"learning_rate": 0.1}}, status=404, names="model_id"),
    # --- saves and loads ------------------------------------------------------------------------
    Case("save-traversal", "POST", "save_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "../escape"}, names="../escape"),
    Case("save-slash", "POST", "save_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "a/b"}, names="a/b"),
    Case("save-surrogate", "POST", "save_weights",
         lambda c: json.dumps({"model_id": c.model_id, "seq_id": c.seq(), "path": "x" + SURROGATE}), names="path"),
    Case("save-long-name", "POST", "save_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "a" * 1000}, names="name"),
    Case("save-ttl-small", "POST", "save_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "t", "ttl_seconds": 1}, names="ttl_seconds"),
    Case("save-ttl-big", "POST", "save_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "t", "ttl_seconds": BIG}, names="ttl_seconds"),
    Case("save-exists", "POST", "save_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "w1"}, names="already exists"),
    Case("save-metadata-int", "POST", "save_weights",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "t", "user_metadata": {"a": 1}}, names="user_metadata"),
    Case("sampler-save-nothing", "POST", "save_weights_for_sampler", lambda c: {"model_id": c.model_id, "seq_id": c.seq()},
         names="sampling_session_seq_id"),
    Case("sampler-save-traversal", "POST", "save_weights_for_sampler",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": ".."}, names=".."),
    Case("sampler-save-kind", "POST", "save_weights_for_sampler",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "q", "kind": "bogus"}, names="kind"),
    Case("load-unknown", "POST", "load_weights",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": c.weights_path + "-nope", "optimizer": False},
         status=404, names="not found"),
    Case("load-sampler-kind", "POST", "load_weights",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": c.sampler_path, "optimizer": False}, names="path"),
    Case("load-malformed", "POST", "load_weights",
         lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": "tinker://../../etc", "optimizer": False}, names="invalid"),
    Case("load-neither", "POST", "load_weights", lambda c: {"path": c.weights_path, "optimizer": False}, names="model_id"),
    Case("load-optimizer-missing", "POST", "load_weights", lambda c: {"model_id": c.model_id, "seq_id": c.seq(), "path": c.weights_path},
         names="optimizer"),
    Case("unload-unknown", "POST", "unload_model", {"model_id": "f" * 32 + ":train:3"}, status=404, names="model_id"),
    # --- sampling -------------------------------------------------------------------------------
    Case("sampling-session-neither", "POST", "create_sampling_session",
         lambda c: {"session_id": c.session_id, "sampling_session_seq_id": 50}, names="base_model"),
    Case("sampling-session-wrong-base", "POST", "create_sampling_session",
         lambda c: {"session_id": c.session_id, "sampling_session_seq_id": 51, "base_model": "x/y"}, names="base_model"),
    Case("sampling-session-bad-path", "POST", "create_sampling_session",
         lambda c: {"session_id": c.session_id, "sampling_session_seq_id": 52, "model_path": "file:///etc/passwd"}, names="invalid"),
    Case("sampling-session-unknown-policy", "POST", "create_sampling_session",
         lambda c: {"session_id": c.session_id, "sampling_session_seq_id": 53, "model_path": "tinker://ghost@prod"},
         status=404, names="ghost"),
    Case("sampling-session-seq-big", "POST", "create_sampling_session",
         lambda c: {"session_id": c.session_id, "sampling_session_seq_id": BIG, "base_model": BASE}, names="sampling_session_seq_id"),
    Case("sampler-unknown", "GET", "samplers/nope", status=404, names="nope"),
    Case("sample-no-session", "POST", "asample", lambda c: sample(c, sampling_session_id=None), names="sampling_session_id"),
    Case("sample-unknown-session", "POST", "asample", lambda c: sample(c, sampling_session_id="nope"), status=404, names="nope"),
    Case("sample-empty-prompt", "POST", "asample", lambda c: sample(c, prompt=tokens([])), names="prompt"),
    Case("sample-token-vocab", "POST", "asample", lambda c: sample(c, prompt=tokens([10**9])), names="prompt"),
    Case("sample-token-bigint", "POST", "asample", lambda c: sample(c, prompt=tokens([BIG])), names="prompt.chunks[0].tokens[0]"),
    Case("sample-num-0", "POST", "asample", lambda c: sample(c, num_samples=0), names="num_samples"),
    Case("sample-num-huge", "POST", "asample", lambda c: sample(c, num_samples=10**6), names="num_samples"),
    Case("sample-num-bigint", "POST", "asample", lambda c: sample(c, num_samples=BIG), names="num_samples"),
    Case("sample-max-tokens-0", "POST", "asample", lambda c: sample(c, {"max_tokens": 0}), names="max_tokens"),
    Case("sample-max-tokens-context", "POST", "asample", lambda c: sample(c, {"max_tokens": 10**6}), names="max_tokens"),
    Case("sample-temperature-neg", "POST", "asample", lambda c: sample(c, {"temperature": -1.0}), names="temperature"),
    Case("sample-temperature-nan", "POST", "asample", lambda c: json.dumps(sample(c, {"temperature": 0.5})).replace("0.5", "NaN"), names="NaN"),
    Case("sample-top-p", "POST", "asample", lambda c: sample(c, {"top_p": 0.0}), names="top_p"),
    Case("sample-top-k", "POST", "asample", lambda c: sample(c, {"top_k": -7}), names="top_k"),
    Case("sample-top-k-0", "POST", "asample", lambda c: sample(c, {"top_k": 0}), names="top_k"),
    Case("sample-no-max-tokens", "POST", "asample",
         lambda c: {**sample(c), "sampling_params": {"temperature": 1.0}}, names="sampling_params.max_tokens"),
    Case("sample-stop-many", "POST", "asample", lambda c: sample(c, {"stop": [str(i) for i in range(17)]}), names="stop"),
    Case("sample-stop-long", "POST", "asample", lambda c: sample(c, {"stop": ["x" * 257]}), names="stop"),
    Case("sample-stop-bigint", "POST", "asample", lambda c: sample(c, {"stop": [1, BIG]}), names="sampling_params.stop[1]"),
    Case("sample-stop-vocab", "POST", "asample", lambda c: sample(c, {"stop": [10**9]}), names="stop"),
    Case("sample-stop-surrogate", "POST", "asample", lambda c: json.dumps(sample(c, {"stop": ["a" + SURROGATE]})), names="stop[0]"),
    Case("sample-seed-bigint", "POST", "asample", lambda c: sample(c, {"seed": BIG}), names="sampling_params.seed"),
    Case("sample-unknown-param", "POST", "asample", lambda c: sample(c, {"grammar": "x"}), names="sampling_params.grammar"),
    Case("sample-logit-bias", "POST", "asample", lambda c: sample(c, {"logit_bias": {"x": 1.0}}),
         names="sampling_params.logit_bias"),
    Case("sample-response-format", "POST", "asample",
         lambda c: sample(c, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}),
         names="sampling_params.response_format"),
    Case("sample-topk-logprobs", "POST", "asample", lambda c: sample(c, topk_sample_logprobs=10**6), names="topk_sample_logprobs"),
    Case("sample-image", "POST", "asample",
         lambda c: sample(c, prompt={"chunks": [{"type": "image", "data": "aGk=", "format": "png", "expected_tokens": 2}]}),
         names="prompt"),
    Case("sample-seq-bigint", "POST", "asample", lambda c: sample(c, seq_id=BIG), names="seq_id"),
    # --- REST views -----------------------------------------------------------------------------
    Case("runs-limit-0", "GET", "training_runs?limit=0", names="limit"),
    Case("runs-limit-big", "GET", f"training_runs?limit={BIG}", names="limit"),
    Case("runs-limit-text", "GET", "training_runs?limit=ten", names="limit"),
    Case("runs-offset-big", "GET", f"training_runs?offset={BIG}", names="offset"),
    Case("run-unknown", "GET", "training_runs/" + "f" * 32 + ":train:0", status=404, names="training run"),
    Case("run-malformed", "GET", "training_runs/..%2F..", status=404, names=""),
    Case("ckpts-limit", "GET", "checkpoints?limit=100000", names="limit"),
    Case("ckpt-delete-kind", "DELETE", CKPT + "/other/x", names="kind"),
    Case("ckpt-delete-traversal", "DELETE", CKPT + "/weights/..%2E", names=".."),
    Case("ckpt-delete-unknown", "DELETE", CKPT + "/weights/nope", status=404, names="nope"),
    Case("ckpt-delete-other-owner", "DELETE", CKPT + "/weights/w1", status=404, names="w1", key=KEY_B),
    Case("ckpt-publish-unknown", "POST", CKPT + "/weights/nope/publish", status=404, names="nope"),
    Case("ckpt-ttl-string", "PUT", CKPT + "/weights/w1/ttl", {"ttl_seconds": "soon"}, names="ttl_seconds"),
    Case("ckpt-ttl-bigint", "PUT", CKPT + "/weights/w1/ttl", {"ttl_seconds": BIG}, names="ttl_seconds"),
    Case("ckpt-ttl-small", "PUT", CKPT + "/weights/w1/ttl", {"ttl_seconds": 5}, names="ttl_seconds"),
    Case("ckpt-ttl-float", "PUT", CKPT + "/weights/w1/ttl", {"ttl_seconds": 3600.5}, names="ttl_seconds"),
    Case("ckpt-archive-unknown", "GET", CKPT + "/weights/nope/archive", status=404, names="nope"),
    Case("archive-bad-token", "GET", "archives/not-a-token", status=404, names="download link", key=None),
    Case("weights-info-missing", "POST", "weights_info", {}, names="tinker_path"),
    Case("weights-info-int", "POST", "weights_info", {"tinker_path": 5}, names="tinker_path"),
    Case("weights-info-surrogate", "POST", "weights_info", json.dumps({"tinker_path": "tinker://" + SURROGATE}), names="tinker_path"),
    Case("weights-info-traversal", "POST", "weights_info", {"tinker_path": "tinker://../../etc/passwd"}, names="invalid"),
    # --- MinT extensions ------------------------------------------------------------------------
    Case("rkl-temperature-0", "POST", "mint/forward_backward_reverse_kl", lambda c: rkl(c, temperature=0.0), names="temperature"),
    Case("rkl-temperature-nan", "POST", "mint/forward_backward_reverse_kl",
         lambda c: json.dumps(rkl(c, temperature=0.25)).replace("0.25", "NaN"), names="NaN"),
    Case("rkl-empty", "POST", "mint/forward_backward_reverse_kl", lambda c: rkl(c, data=[]), names="datums"),
    Case("rkl-reference-base", "POST", "mint/forward_backward_reverse_kl",
         lambda c: rkl(c, reference_model_path="other/model"), names="reference_model_path"),
    Case("rkl-reference-vocab", "POST", "mint/forward_backward_reverse_kl",
         lambda c: rkl(c, datum={"reference_input": tokens([10**9])}), names="reference_input"),
    Case("rkl-reference-bigint", "POST", "mint/forward_backward_reverse_kl",
         lambda c: rkl(c, datum={"reference_input": tokens([BIG])}), names="reference_input"),
    # its tensors pass codec.check_tensor like every request tensor, sparse CSR included
    Case("rkl-csr-malformed", "POST", "mint/forward_backward_reverse_kl", lambda c: rkl(c, datum={"target_tokens": {
        "data": [7], "dtype": "int64", "shape": [3, 1], "sparse_crow_indices": [0, 1, 1, 1], "sparse_col_indices": [5]}}),
         names="data[0].target_tokens.sparse_col_indices"),
    Case("rkl-target-fraction", "POST", "mint/forward_backward_reverse_kl",
         lambda c: rkl(c, datum={"target_tokens": {"data": [2, 3.5, 4], "dtype": "int64"}}), names="data[0].target_tokens.data"),
    Case("rkl-shape-negative", "POST", "mint/forward_backward_reverse_kl",
         lambda c: rkl(c, datum={"weights": {"data": [1.0, 1.0, 1.0], "shape": [-1]}}), names="data[0].weights.shape"),
    Case("rkl-weights-nan", "POST", "mint/forward_backward_reverse_kl",
         lambda c: json.dumps(rkl(c, datum={"weights": {"data": [1.0, 0.25, 1.0]}})).replace("0.25", "NaN"),
         names="data[0].weights.data"),
    Case("rkl-missing-model", "POST", "mint/forward_backward_reverse_kl", lambda c: unused(c, rkl(c), model_id=None), names="model_id"),
    Case("interp-empty", "POST", "mint/checkpoints/interpolate", {"source_paths": [], "coefficients": []}, names="source_paths"),
    Case("interp-mismatch", "POST", "mint/checkpoints/interpolate",
         lambda c: {"source_paths": [c.sampler_path], "coefficients": [0.5, 0.5]}, names="coefficients"),
    Case("interp-nan", "POST", "mint/checkpoints/interpolate",
         lambda c: json.dumps({"source_paths": [c.sampler_path], "coefficients": [0.25]}).replace("0.25", "NaN"), names="NaN"),
    Case("interp-inf", "POST", "mint/checkpoints/interpolate",
         lambda c: json.dumps({"source_paths": [c.sampler_path], "coefficients": [0.25]}).replace("0.25", "1e999"), names="coefficients"),
    Case("interp-policy-first", "POST", "mint/checkpoints/interpolate",
         lambda c: {"source_paths": [f"tinker://{c.policy}@1"], "coefficients": [1.0]}, names="first source path"),
    Case("interp-output-name", "POST", "mint/checkpoints/interpolate",
         lambda c: {"source_paths": [c.sampler_path], "coefficients": [1.0], "output_path": "../x"}, names="output_path"),
    Case("interp-unknown", "POST", "mint/checkpoints/interpolate",
         lambda c: {"source_paths": [c.sampler_path + "-nope"], "coefficients": [1.0]}, status=404, names="not found"),
    # --- catalog REST ---------------------------------------------------------------------------
    Case("cat-bad-name", "POST", CAT + "/policies", {"name": "no spaces", "base_model": BASE}, names="name"),
    Case("cat-unserved-base", "POST", CAT + "/policies", {"name": "p2", "base_model": "other/model"}, names="base_model"),
    Case("cat-metadata-surrogate", "POST", CAT + "/policies",
         json.dumps({"name": "p3", "base_model": BASE, "metadata": {"k": SURROGATE}}), names="metadata.k"),
    Case("cat-metadata-nan", "POST", CAT + "/policies", '{"name": "p4", "base_model": "tiny/llama", "metadata": {"k": NaN}}', names="NaN"),
    Case("cat-metadata-bigint", "POST", CAT + "/policies", {"name": "p5", "base_model": BASE, "metadata": {"k": BIG}}, names="metadata.k"),
    Case("cat-metadata-deep", "POST", CAT + "/policies",
         '{"name": "p6", "base_model": "tiny/llama", "metadata": {"k": ' + deep(40) + "}}", names="metadata.k"),
    Case("cat-lora-rank-0", "POST", CAT + "/policies", {"name": "p7", "base_model": BASE, "lora_config": {"rank": 0}}, names="lora_config.rank"),
    Case("cat-lora-rank-str", "POST", CAT + "/policies", {"name": "p8", "base_model": BASE, "lora_config": {"rank": "2"}}, names="lora_config.rank"),
    Case("cat-lora-unknown", "POST", CAT + "/policies", {"name": "p9", "base_model": BASE, "lora_config": {"bogus": 1}}, names="lora_config.bogus"),
    Case("cat-lora-alpha-neg", "POST", CAT + "/policies", {"name": "pa", "base_model": BASE, "lora_config": {"alpha": -1}}, names="lora_config.alpha"),
    Case("cat-lora-dropout", "POST", CAT + "/policies", {"name": "pb", "base_model": BASE, "lora_config": {"dropout": 1.5}}, names="lora_config.dropout"),
    Case("cat-lora-modules", "POST", CAT + "/policies", {"name": "pc", "base_model": BASE, "lora_config": {"target_modules": [1]}}, names="target_modules"),
    Case("cat-missing-base", "POST", CAT + "/policies", {"name": "pd"}, names="base_model"),
    Case("cat-exists", "POST", CAT + "/policies", lambda c: {"name": c.policy, "base_model": BASE}, status=409, names="already exists"),
    Case("cat-unknown-policy", "GET", CAT + "/policies/ghost", status=404, names="ghost"),
    Case("cat-cursor-garbage", "GET", CAT + "/policies?cursor=garbage", names="cursor"),
    Case("cat-cursor-other-listing", "GET", CAT + "/policies?cursor=" + cursor("revisions", 3), names="cursor"),
    Case("cat-cursor-bigint", "GET", CAT + "/policies/{policy}/revisions?cursor=" + cursor("revisions", BIG), names="cursor"),
    Case("cat-cursor-surrogate", "GET", CAT + "/policies?cursor=" + cursor("policies", SURROGATE), names="cursor"),
    Case("cat-cursor-history", "GET", CAT + "/policies/{policy}/aliases/prod/history?cursor=" + cursor("alias_history", -BIG), names="cursor"),
    Case("cat-limit-0", "GET", CAT + "/policies?limit=0", names="limit"),
    Case("cat-limit-big", "GET", CAT + f"/policies?limit={BIG}", names="limit"),
    Case("cat-revision-bigint", "PUT", CAT + "/policies/{policy}/aliases/prod", {"revision": BIG}, names="revision"),
    Case("cat-revision-missing", "PUT", CAT + "/policies/{policy}/aliases/prod", {"revision": 99}, status=404, names="revision 99"),
    Case("cat-alias-name", "PUT", CAT + "/policies/{policy}/aliases/9bad", {"revision": 1}, names="alias"),
    Case("cat-alias-reason-surrogate", "PUT", CAT + "/policies/{policy}/aliases/prod",
         json.dumps({"revision": 1, "reason": SURROGATE}), names="reason"),
    Case("cat-rollback-none", "POST", CAT + "/policies/{policy}/aliases/fresh/rollback", status=404, names="fresh"),
    Case("cat-ref-bad", "GET", CAT + "/revisions/{policy}@0", names="@0"),
    Case("cat-ref-unknown", "GET", CAT + "/revisions/ghost@prod", status=404, names="ghost"),
    Case("cat-lineage-bad", "GET", CAT + "/revisions/a@b@c/lineage", names="a@b@c"),
    Case("cat-eval-inf", "POST", CAT + "/revisions/{policy}@1/evals", '{"metric": "acc", "value": 1e999}', names="value"),
    Case("cat-eval-nan", "POST", CAT + "/revisions/{policy}@1/evals", '{"metric": "acc", "value": NaN}', names="NaN"),
    Case("cat-eval-metric-surrogate", "POST", CAT + "/revisions/{policy}@1/evals",
         json.dumps({"metric": SURROGATE, "value": 1.0}), names="metric"),
    Case("cat-eval-value-str", "POST", CAT + "/revisions/{policy}@1/evals", {"metric": "acc", "value": "high"}, names="value"),
    Case("cat-import-garbage", "POST", CAT + "/policies/{policy}/revisions", b"not an archive", names="archive"),
    Case("cat-import-empty", "POST", CAT + "/policies/{policy}/revisions", b"", names="archive"),
    Case("cat-import-step-neg", "POST", CAT + "/policies/{policy}/revisions?step=-1", b"x", names="step"),
    Case("cat-import-step-big", "POST", CAT + f"/policies/{{policy}}/revisions?step={BIG}", b"x", names="step"),
    Case("cat-import-unserved", "POST", CAT + "/policies/{policy}/revisions?base_model=other/model", b"x", names="base_model"),
    Case("cat-export-format", "GET", CAT + "/revisions/{policy}@1/archive?format=rar", names="format"),
]


def _request(ctx: Ctx, case: Case) -> httpx.Response:
    body = _fill(case.body, ctx) if callable(case.body) else case.body
    headers = dict(case.headers)
    if case.key:
        headers["X-API-Key"] = case.key
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif isinstance(body, str):
        kwargs["content"] = body.encode("utf-8", "surrogatepass")
        headers.setdefault("content-type", "application/json")
    elif body is not None:
        kwargs["json"] = body
    path = _fill(case.path, ctx)
    return ctx.http.request(case.method, f"{ctx.server.url}/api/v1/{path}", headers=headers, **kwargs)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "catalog.db" not in p.name)


def snapshot(ctx: Ctx) -> dict[str, Any]:
    """What the server holds: runs, checkpoints, sessions, catalog rows, models, samplers, engine
    work done and files on disk. Read in-process: over HTTP it would cost a dozen requests a case."""
    core = ctx.server.service.core
    catalog = core.policies.catalog
    owner = owner_id(KEY_A)
    policies = catalog.list_policies(owner, limit=1000).items
    return {
        "runs": [asdict(r) for r in core.stores.runs.list_runs(owner)],
        "checkpoints": [asdict(r) for r in core.stores.runs.list_owner_checkpoints(owner)],
        "sessions": [s.session_id for s in core.stores.sessions.owned(owner)],
        "policies": policies,
        "revisions": {p.name: catalog.list_revisions(owner, p.name, limit=1000).items for p in policies},
        "aliases": {p.name: catalog.list_aliases(owner, p.name, limit=1000).items for p in policies},
        "evals": catalog.list_evals(owner, f"{ctx.policy}@1", limit=1000).items,
        "models": sorted(core.stores.models),
        "samplers": sorted(core.stores.samplers),
        "engine": {k: ctx.server.engine.stats[k] for k in ("train_passes", "fused_requests", "ops")},
        "files": _files(ctx.server.settings.data_dir / "runs"),
    }


@pytest.fixture(scope="module")
def ctx(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctx]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("bad-input") / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=2, user_metadata={"policy": "pol"}).result()
        train(tc, 1)
        weights = tc.save_state("w1").result().path
        sampler_path = tc.save_weights_for_sampler("s1").result().path
        sc = client.create_sampling_client(model_path=sampler_path).result()
        api = httpx.Client(base_url=f"{server.url}/api/v1/{CAT}", headers={"X-API-Key": KEY_A}, timeout=60)
        assert api.put("/policies/pol/aliases/prod", json={"revision": 1}).status_code == 200
        api.close()
        assert sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result().sequences
        model = server.service.core.stores.models[tc.model_id]
        samplers = server.service.core.stores.samplers.values()
        sampler_id = next(s.sampler_id for s in samplers if s.model_path == sampler_path)
        ctx = Ctx(server, model.session_id, tc.model_id, sampler_id, weights, sampler_path, "pol",
                  model.sequencer.next_seq)  # fmt: skip
        with ctx.http:
            yield ctx
        client.close("success")


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(ctx: Ctx, case: Case) -> None:
    before = ctx.state if ctx.state is not None else snapshot(ctx)
    r = _request(ctx, case)
    assert r.status_code == case.status, f"{case.id}: {r.status_code} {r.text[:500]}"
    detail = r.json()["detail"]
    assert isinstance(detail, str) and case.names in detail, f"{case.id}: {detail!r} does not name {case.names!r}"
    still = ctx.http.get(f"{ctx.server.url}/api/v1/training_runs", headers={"X-API-Key": KEY_A}, timeout=10)
    assert still.status_code == 200 and still.json()["training_runs"]
    ctx.state = snapshot(ctx)
    assert ctx.state == before, case.id


def test_refused_requests_gave_up_their_seq_ids(ctx: Ctx) -> None:
    """Every refused ordered request above took a seq_id; the model's next request still runs."""
    sequencer = ctx.server.service.core.stores.models[ctx.model_id].sequencer
    api = httpx.Client(base_url=f"{ctx.server.url}/api/v1", headers={"X-API-Key": KEY_A}, timeout=60)
    with api:
        r = api.post("forward", json={"model_id": ctx.model_id, "seq_id": ctx.seq(), "forward_input": {
            "loss_fn": "cross_entropy", "data": [{"model_input": tokens([1, 2, 3]),
                                                  "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}}}]}})  # fmt: skip
        assert r.status_code == 200, r.text
        request_id = r.json()["request_id"]
        # A seq_id left unconsumed would hold this forever; the long poll shows the gap instead.
        for _ in range(3):
            out = api.post("retrieve_future", json={"request_id": request_id}).json()
            if out.get("type") != "try_again":
                break
        assert out.get("type") != "try_again", f"stuck at seq_id {sequencer.next_seq}; the forward took {ctx.next_seq - 1}"
        assert out["metrics"]["loss:sum"] > 0, out
