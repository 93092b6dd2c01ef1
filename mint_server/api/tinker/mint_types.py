"""Wire shapes that are not in the `tinker` package (docs/wire-protocol.md): the two
mindlab-toolkit extension endpoints (`/api/v1/mint/...`), MinT's own, and the sampling controls
that `/api/v1/asample` takes beyond tinker's SamplingParams.

mindlab-toolkit pins tinker 0.22 and cannot be a server dependency, so its shapes are declared here;
those requests ignore unknown fields, like the client's own models do. Sampling params do not: a
field this server does not know is a 400 naming it, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tinker import types


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WireTensor(_Wire):
    """A tensor as tinker's TensorData carries it: dense, or sparse CSR when both index lists are
    given (codec.check_tensor's rules; the served schema states them, api/http/spec_bounds.py)."""

    data: list[int] | list[float] | float
    shape: list[int] | None = None
    dtype: Literal["float32", "int64"] = "float32"
    sparse_crow_indices: list[int] | None = None  # CSR row pointers: rows + 1 of them
    sparse_col_indices: list[int] | None = None  # CSR column of each value


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


# --- sampling controls beyond tinker's SamplingParams ----------------------------------------------
EXTENSIONS_HEADER = "X-Mint-Sampling-Params"


class SamplingExtensions(BaseModel):
    """OpenAI's and vLLM's sampling controls, on the Tinker face: in an /asample body's
    `sampling_params`, or (the tinker SDK drops fields its SamplingParams does not declare before
    sending) as a JSON object in the X-Mint-Sampling-Params header. The engine's job parser checks
    the values (jobs.Preparer.sample), as it does the OpenAI face's."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # {token id: bias in [-100, 100]}
    response_format: dict[str, Any] | None = None  # json_object / json_schema / regex / lark (engine/grammar.py)
    # "raw_logprobs" (the default: the model's own, what training computes) or "processed_logprobs"
    # (after temperature, top-k, top-p, min-p, penalties, logit_bias and a grammar: what the draw used)
    logprobs_mode: str | None = None

    def given(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SamplingExtensions.model_fields
                if getattr(self, name) is not None}


class MintSamplingParams(types.SamplingParams, SamplingExtensions):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MintSampleRequest(types.SampleRequest):
    sampling_params: MintSamplingParams
# --- MinT's own endpoints: unknown fields are refused, never ignored --------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EvalRequest(_Strict):
    """`POST /api/v1/mint/evals` (see api/catalog/evals.py)."""

    revisions: list[str] = Field(min_length=1, max_length=32)  # NAME@N, NAME@ALIAS, NAME@<sha prefix>
    metric: Literal["exact_match", "contains", "regex", "logprob"]
    dataset: list[dict[str, Any]] = Field(min_length=1)  # {"prompt": str, "target": str} each
    dataset_name: str = Field(default="dataset", min_length=1, max_length=200)
    max_tokens: int = Field(default=64, ge=1)
    chat: bool = False  # render each prompt as a user message through the chat template
    record: bool = True  # store the scores as eval records on the revisions
    include_outputs: bool = False  # return each example's completion per revision


class EvalRevisionResult(BaseModel):
    revision: str  # NAME@N: the revision the reference named when the eval ran
    sha256: str
    value: float
    n: int
    eval_id: int | None = None  # the eval record, when recorded
    outputs: list[str] | None = None


class EvalResponse(BaseModel):
    metric: str
    dataset: str  # as recorded: the dataset name and a hash of its content
    results: list[EvalRevisionResult]
    type: Literal["mint_eval"] = "mint_eval"


class RunMetricsReport(_Strict):
    """`POST /api/v1/mint/runs/{run_id}/metrics`: what only the client knows about a step (rewards …)."""

    metrics: dict[str, Any]
    step: int | None = Field(default=None, ge=0)  # default: the run's optimizer steps so far
