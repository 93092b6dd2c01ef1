"""Wire shapes of the two mindlab-toolkit extension endpoints (`/api/v1/mint/...`).

These are the only wire types not in the `tinker` package: mindlab-toolkit pins tinker 0.22 and
cannot be a server dependency, so the shapes (see docs/wire-protocol.md) are declared here.
Requests ignore unknown fields, like the client's own models do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from tinker import types


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WireTensor(_Wire):
    data: list[int] | list[float] | float
    shape: list[int] | None = None
    dtype: Literal["float32", "int64"] = "float32"


class ReverseKLDatum(_Wire):
    student_input: types.ModelInput
    reference_input: types.ModelInput
    target_tokens: WireTensor
    weights: WireTensor


class ForwardBackwardReverseKLRequest(_Wire):
    model_id: str
    reference_model_path: str
    data: list[ReverseKLDatum]
    temperature: float = 1.0
    seq_id: int | None = None


class ReverseKLItemOutput(_Wire):
    loss: WireTensor


class ForwardBackwardReverseKLResponse(_Wire):
    outputs: list[ReverseKLItemOutput]
    metrics: dict[str, float]
    type: Literal["mint_forward_backward_reverse_kl"] = "mint_forward_backward_reverse_kl"


class InterpolateCheckpointsRequest(_Wire):
    source_paths: list[str]
    coefficients: list[float]
    output_path: str | None = None
    output_checkpoint_type: Literal["sampler"] = "sampler"


class InterpolateCheckpointsResponse(_Wire):
    path: str
    checkpoint_type: Literal["sampler"] = "sampler"
    source_paths: list[str]
    coefficients: list[float]
    has_rank_shards: bool = False
    type: Literal["mint_interpolate_checkpoints"] = "mint_interpolate_checkpoints"
