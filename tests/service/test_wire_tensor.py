"""The MinT extensions' WireTensor takes what tinker's TensorData and the codec take (issue 52): dense,
or sparse CSR when both index lists are given. A checked CSR tensor reaches the engine densified; a
malformed one is the codec's 400 naming the field and the rule; the served schema describes both."""

from __future__ import annotations

import pytest

from mint_server.api.http.spec_bounds import COMPONENTS
from mint_server.api.tinker.codec import DecodeError
from mint_server.api.tinker.extensions import _tensor
from mint_server.api.tinker.mint_types import WireTensor


def test_a_csr_tensor_reaches_the_engine_densified() -> None:
    sparse = WireTensor(data=[0.5, 2.0, 3.0], shape=[3, 2], sparse_crow_indices=[0, 1, 1, 3], sparse_col_indices=[1, 0, 1])
    dense = _tensor(sparse, "data[0].weights")
    assert dense.shape == [3, 2] and dense.data == [0.0, 0.5, 0.0, 0.0, 2.0, 3.0]
    ids = WireTensor(data=[7, 9], dtype="int64", shape=[2, 3], sparse_crow_indices=[0, 1, 2], sparse_col_indices=[2, 0])
    assert _tensor(ids, "data[0].target_tokens").data == [0, 0, 7, 9, 0, 0]


def test_a_malformed_csr_tensor_is_refused_naming_the_field() -> None:
    bad = WireTensor(data=[7], dtype="int64", shape=[3, 1], sparse_crow_indices=[0, 1, 1, 1], sparse_col_indices=[5])
    with pytest.raises(DecodeError, match=r"data\[0\]\.target_tokens\.sparse_col_indices'.*outside the row width"):
        _tensor(bad, "data[0].target_tokens")
    half = WireTensor(data=[1.0], shape=[1, 1], sparse_crow_indices=[0, 1])
    with pytest.raises(DecodeError, match="given together"):
        _tensor(half, "data[0].weights")


def test_the_served_schema_describes_dense_and_csr_tensors() -> None:
    fields = set(WireTensor.model_json_schema()["properties"])
    assert {"data", "shape", "dtype", "sparse_crow_indices", "sparse_col_indices"} <= fields
    variants = COMPONENTS["WireTensor"]["anyOf"]
    sparse = [v for v in variants if "sparse_crow_indices" in v["required"]]
    assert len(sparse) == 2 and all(v["properties"]["shape"]["minItems"] == 2 for v in sparse)  # int64 and float32
