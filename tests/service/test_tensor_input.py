"""Every tensor of a request is checked where it is decoded, before torch sees it (issue 52, item 1).

Malformed sparse CSR tensors (a column past the row width, a row pointer that decreases or does
not end at the number of values, a 1-D shape), float token ids on the JSON path and impossible
shapes are each a 400 naming the field and the rule, on the JSON and the protobuf path alike. A
refused ordered request gives up its seq_id (the model's next request runs) and a resubmission of
it (the SDK retries with the same seq_id) gets the same error again, not "seq_id N was already
used". An exception no rule names is never a bare 500: it carries an error id.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker.proto import tinker_public_pb2 as pb

from mint_server.api.tinker.codec import DecodeError, _RawTensor, check_tensor
from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine

PROTO = {"content-type": "application/x-protobuf", "X-API-Key": KEY_A}


class Model:
    def __init__(self, server: LiveServer, model_id: str) -> None:
        self.server, self.model_id = server, model_id
        self.http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A}, timeout=60)
        self.next_seq = server.service.core.stores.models[model_id].sequencer.next_seq

    def seq(self) -> int:
        """A fresh seq_id: every request below takes one, refused or not (a refused one gives it up)."""
        self.next_seq += 1
        return self.next_seq - 1

    def result(self, request_id: str) -> dict[str, Any]:
        for _ in range(20):
            out = self.http.post("retrieve_future", json={"request_id": request_id}).json()
            if out.get("type") != "try_again":
                return out
        raise AssertionError(f"request {request_id} never finished")


@pytest.fixture(scope="module")
def model(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("tensors") / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=2).result()
        m = Model(server, tc.model_id)
        with m.http:
            yield m
        client.close("success")


def json_fb(m: Model, seq_id: int, inputs: dict[str, Any], n: int = 3) -> dict[str, Any]:
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": list(range(1, n + 1))}]},
             "loss_fn_inputs": inputs}
    return {"model_id": m.model_id, "seq_id": seq_id,
            "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"}}


TARGETS_3x2 = {"data": [2, 3, 3, 4, 4, 5], "dtype": "int64", "shape": [3, 2]}


def csr(crow: list[int], col: list[int], values: list[float], shape: list[int] | None) -> dict[str, Any]:
    return {"data": values, "dtype": "float32", "shape": shape, "sparse_crow_indices": crow, "sparse_col_indices": col}


# (id, weights tensor for a [3, 2] target, the rule the 400 must name)
BAD_CSR = [
    ("column-past-row", csr([0, 1, 2, 3], [0, 2, 1], [1, 1, 1], [3, 2]), "outside the row width"),
    ("negative-column", csr([0, 1, 2, 3], [0, -1, 1], [1, 1, 1], [3, 2]), "outside the row width"),
    ("decreasing-rows", csr([0, 2, 1, 3], [0, 1, 1], [1, 1, 1], [3, 2]), "must not decrease"),
    ("rows-past-values", csr([0, 1, 2, 5], [0, 1, 1], [1, 1, 1], [3, 2]), "number of values"),
    ("rows-short-of-values", csr([0, 1, 1, 2], [0, 1, 1], [1, 1, 1], [3, 2]), "number of values"),
    ("not-starting-at-0", csr([1, 1, 2, 3], [0, 1, 1], [1, 1, 1], [3, 2]), "start at 0"),
    ("wrong-row-count", csr([0, 1, 3], [0, 0, 1], [1, 1, 1], [3, 2]), "row pointers"),
    ("1-d-shape", csr([0, 1, 2, 3], [0, 1, 1], [1, 1, 1], [6]), "2-D shape"),
    ("no-shape", csr([0, 1, 2, 3], [0, 1, 1], [1, 1, 1], None), "2-D shape"),
    ("columns-unsorted", csr([0, 2, 2, 3], [1, 0, 1], [1, 1, 1], [3, 2]), "strictly increasing"),
    ("columns-repeated", csr([0, 2, 2, 3], [1, 1, 1], [1, 1, 1], [3, 2]), "strictly increasing"),
    ("fewer-columns-than-values", csr([0, 1, 2, 3], [0, 1], [1, 1, 1], [3, 2]), "one column per value"),
    ("crow-without-col", {"data": [1.0], "dtype": "float32", "shape": [3, 2], "sparse_crow_indices": [0, 1, 1, 1]},
     "together"),
    ("huge-dense-size", csr([0, 0, 0, 0], [], [], [3, 2**40]), "exceed the limit"),
]


@pytest.mark.parametrize("tensor,rule", [c[1:] for c in BAD_CSR], ids=[c[0] for c in BAD_CSR])
def test_malformed_sparse_tensor_is_a_400_on_json(model: Model, tensor: dict[str, Any], rule: str) -> None:
    seq = model.seq()
    body = json_fb(model, seq, {"target_tokens": TARGETS_3x2, "weights": tensor})
    r = model.http.post("forward_backward", json=body)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "loss_fn_inputs.weights" in detail and rule in detail, detail
    # The SDK's resubmission of the same request gets the same answer, not "already used".
    again = model.http.post("forward_backward", json=body)
    assert (again.status_code, again.json()["detail"]) == (400, detail)


def _proto_tensor(t: dict[str, Any]) -> pb.Tensor:
    values = np.asarray(t["data"], dtype=np.float32).tobytes()
    msg = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=t.get("shape") or [])
    if "sparse_crow_indices" in t:
        msg.sparse_csr.CopyFrom(pb.SparseCsr(
            values=values, crow_indices=np.asarray(t["sparse_crow_indices"], dtype=np.int64).tobytes(),
            col_indices=np.asarray(t.get("sparse_col_indices", []), dtype=np.int64).tobytes()))
    else:
        msg.dense = values
    return msg


def proto_fb(m: Model, seq_id: int, weights: pb.Tensor) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=m.model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.append(pb.Chunk(encoded_text=pb.EncodedTextChunk(
        tokens=np.asarray([1, 2, 3], dtype=np.int32).tobytes())))
    datum.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(
        dense=np.asarray(TARGETS_3x2["data"], dtype=np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[3, 2]))
    datum.loss_fn_inputs["weights"].CopyFrom(weights)
    return msg.SerializeToString()


PROTO_CASES = [c for c in BAD_CSR if c[0] not in ("crow-without-col", "no-shape", "1-d-shape")]


@pytest.mark.parametrize("tensor,rule", [c[1:] for c in PROTO_CASES], ids=[c[0] for c in PROTO_CASES])
def test_malformed_sparse_tensor_is_a_400_on_protobuf(model: Model, tensor: dict[str, Any], rule: str) -> None:
    r = model.http.post("forward_backward", content=proto_fb(model, model.seq(), _proto_tensor(tensor)),
                        headers=PROTO)
    assert r.status_code == 400, r.text
    assert "loss_fn_inputs.weights" in r.json()["detail"] and rule in r.json()["detail"], r.text


def test_one_dimensional_sparse_shape_on_protobuf(model: Model) -> None:
    weights = _proto_tensor(csr([0, 1, 2, 3], [0, 1, 1], [1, 1, 1], [6]))
    r = model.http.post("forward_backward", content=proto_fb(model, model.seq(), weights), headers=PROTO)
    assert r.status_code == 400 and "2-D shape" in r.json()["detail"], r.text


def test_well_formed_sparse_tensor_trains(model: Model) -> None:
    """The same tensors, laid out right, reach the engine and train (the checks refuse only bad ones)."""
    weights = csr([0, 1, 2, 2], [0, 1], [1.0, 0.5], [3, 2])  # [[1, 0], [0, 0.5], [0, 0]]
    r = model.http.post("forward_backward", json=json_fb(model, model.seq(), {"target_tokens": TARGETS_3x2,
                                                                             "weights": weights}))
    assert r.status_code == 200, r.text
    json_loss = model.result(r.json()["request_id"])["metrics"]["loss:sum"]
    r = model.http.post("forward_backward", content=proto_fb(model, model.seq(), _proto_tensor(weights)),
                        headers=PROTO)
    assert r.status_code == 200, r.text
    assert model.result(r.json()["request_id"])["metrics"]["loss:sum"] == pytest.approx(json_loss)


@pytest.mark.parametrize("target", [
    {"data": [2, 33.5, 4], "dtype": "int64"},  # a tensor
    [2, 33.5, 4],  # a plain list (the SDK's table gives target_tokens int64)
    {"data": [2, 3, 4, 5.25, 6, 7], "dtype": "int64", "shape": [3, 2]},
], ids=["tensor", "plain-list", "2-d"])
def test_float_token_ids_are_refused_on_json(model: Model, target: Any) -> None:
    r = model.http.post("forward_backward", json=json_fb(model, model.seq(), {"target_tokens": target}))
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "loss_fn_inputs.target_tokens" in detail and "integers" in detail, detail


@pytest.mark.parametrize("tensor,rule", [
    ({"data": [2, 3, 4], "dtype": "int64", "shape": [2, 2]}, "holds 4 values"),
    ({"data": [2, 3, 4], "dtype": "int64", "shape": [-1]}, ">= 0"),
    ({"data": [2, 3, 4], "dtype": "int64", "shape": [3, 1, 1, 1, 1]}, "dimensions"),
    ({"data": [2, 3, 1e30], "dtype": "int64"}, "int64 range"),
], ids=["shape-mismatch", "negative-dim", "rank", "beyond-int64"])
def test_bad_dense_tensor_is_a_400(model: Model, tensor: dict[str, Any], rule: str) -> None:
    r = model.http.post("forward_backward", json=json_fb(model, model.seq(), {"target_tokens": tensor}))
    assert r.status_code == 400 and rule in r.json()["detail"], r.text


def test_refused_seq_id_is_given_up_and_replayed(model: Model) -> None:
    """The refused request's seq_id does not hold the next one, and its retry sees the real error."""
    bad = json_fb(model, model.seq(), {"target_tokens": {"data": [2, 3.5, 4], "dtype": "int64"}})
    first = model.http.post("forward_backward", json=bad)
    assert first.status_code == 400, first.text
    ok = model.http.post("forward", json={"model_id": model.model_id, "seq_id": model.seq(), "forward_input":
                                          json_fb(model, 0, {"target_tokens": [2, 3, 4]})["forward_backward_input"]})
    assert ok.status_code == 200, ok.text
    assert model.result(ok.json()["request_id"])["metrics"]["loss:sum"] > 0  # it ran: nothing waits for `bad`
    retry = model.http.post("forward_backward", json=bad)
    assert retry.status_code == 400 and retry.json()["detail"] == first.json()["detail"], retry.text


def test_an_unnamed_engine_exception_is_never_a_bare_500(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault no rule names (injected: the engine's input preparation raising RuntimeError) is a
    400 with an error id for an ordered request — replayed on resubmission — and a 503 with an
    error id elsewhere (sampling)."""
    engine = model.server.engine

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine, "prepare_train", broken)
    body = json_fb(model, model.seq(), {"target_tokens": [2, 3, 4]})
    r = model.http.post("forward_backward", json=body)
    assert r.status_code == 400, r.text
    assert "RuntimeError: injected fault" in r.json()["detail"] and "error id" in r.json()["detail"], r.text
    again = model.http.post("forward_backward", json=body)
    assert again.json()["detail"] == r.json()["detail"]

    monkeypatch.setattr(engine, "prepare_sample", broken)
    session = model.http.post("create_sampling_session", json={
        "session_id": model.server.service.core.stores.models[model.model_id].session_id,
        "sampling_session_seq_id": 9000, "base_model": BASE}).json()["sampling_session_id"]
    r = model.http.post("asample", json={"sampling_session_id": session, "seq_id": 1, "num_samples": 1,
                                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                         "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 503, r.text
    assert "error id" in r.json()["detail"] and r.headers.get("x-error-id"), r.text


# --- the checks agree with torch's own invariants ----------------------------------------------------
def test_check_tensor_accepts_exactly_what_torch_can_densify() -> None:
    """Random CSR layouts, valid and broken in every way: whatever check_tensor accepts densifies
    in torch (with its invariant checks on); every layout torch refuses, check_tensor refuses (it
    is stricter only where torch is lax: a 0-row tensor's one row pointer must still be 0)."""
    rng = random.Random(52)
    accepted = refused = 0
    for _ in range(3000):
        rows, cols = rng.randint(0, 4), rng.randint(0, 4)
        dense = torch.tensor([[float(rng.random() < 0.4) for _ in range(cols)] for _ in range(rows)])
        crow = [0]
        col: list[int] = []
        for r in range(rows):
            col += [c for c in range(cols) if dense[r, c]] if rows and cols else []
            crow.append(len(col))
        values = [1.0] * len(col)
        for _ in range(rng.randint(0, 2)):  # break it, or not
            kind = rng.randint(0, 5)
            if kind == 0 and col:
                col[rng.randrange(len(col))] = rng.randint(-2, cols + 2)
            elif kind == 1:
                if crow:
                    crow[rng.randrange(len(crow))] = rng.randint(-1, len(col) + 2)
            elif kind == 2:
                values = values + [1.0] if rng.random() < 0.5 else values[:-1]
            elif kind == 3:
                col = col + [rng.randint(0, cols)] if rng.random() < 0.5 else col[:-1]
            elif kind == 4:
                crow = crow + [len(col)] if rng.random() < 0.5 else crow[:-1]
        shape = [rows, cols]
        try:
            check_tensor(_RawTensor(values, "float32", shape, crow, col), "t")
            ok = True
        except DecodeError:
            ok = False
        try:
            with torch.sparse.check_sparse_tensor_invariants():
                torch.sparse_csr_tensor(torch.tensor(crow, dtype=torch.int64), torch.tensor(col, dtype=torch.int64),
                                        torch.tensor(values), size=shape).to_dense()
            torch_ok = True
        except (RuntimeError, ValueError, IndexError):
            torch_ok = False
        assert torch_ok or not ok, (shape, crow, col, values)  # accepted → torch densifies it
        accepted += ok
        refused += not ok
    assert accepted > 500 and refused > 500
