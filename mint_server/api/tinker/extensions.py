"""The mindlab-toolkit extensions: reverse-KL forward/backward against a reference model, and
linear interpolation of checkpoints into a new sampler checkpoint.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np
from tinker import types

from mint_server.api.auth.keys import Principal
from mint_server.api.core import Core
from mint_server.api.state.clients import TrainingModel
from mint_server.api.tinker.codec import check_tensor, tensor_json
from mint_server.api.tinker.mint_types import (
    ForwardBackwardReverseKLRequest,
    ForwardBackwardReverseKLResponse,
    InterpolateCheckpointsRequest,
    InterpolateCheckpointsResponse,
    ReverseKLItemOutput,
    WireTensor,
)
from mint_server.api.tinker.paths import CheckpointRef, check_name, is_checkpoint_path, parse_policy_ref
from mint_server.api.tinker.training import TrainingService
from mint_server.api.tinker.validate import InvalidInput
from mint_server.engine.interface import AdapterSource, ReverseKLDatum


def _tensor(t: WireTensor, field: str) -> types.TensorData:
    data = t.data if isinstance(t.data, list) else [t.data]
    check_tensor(t.model_copy(update={"data": data}), field)  # as every request tensor: a 400 naming the field
    if t.sparse_crow_indices is not None and t.shape is not None:  # checked CSR: densified, as TensorData.to_torch does
        dense = np.zeros(t.shape, dtype=np.int64 if t.dtype == "int64" else np.float64)
        rows = np.repeat(np.arange(t.shape[0]), np.diff(np.asarray(t.sparse_crow_indices, dtype=np.int64)))
        dense[rows, np.asarray(t.sparse_col_indices, dtype=np.int64)] = data
        data = dense.reshape(-1).tolist()
    try:
        return types.TensorData(data=data, dtype=t.dtype, shape=t.shape or [len(data)])
    except (ValueError, OverflowError, TypeError) as e:
        raise InvalidInput(f"{field}: {e}") from None


def _datums(req: ForwardBackwardReverseKLRequest) -> list[ReverseKLDatum]:
    return [
        ReverseKLDatum(
            student_input=d.student_input, reference_input=d.reference_input,
            target_tokens=_tensor(d.target_tokens, f"data[{i}].target_tokens"),
            weights=_tensor(d.weights, f"data[{i}].weights"),
        )
        for i, d in enumerate(req.data)
    ]


class MintService:
    def __init__(self, core: Core, training: TrainingService) -> None:
        self.admission = core.admission
        self.stores = core.stores
        self.sources = core.sources
        self.work = core.work
        self.engine = core.work.engine
        self.training = training

    def reverse_kl(self, p: Principal, req: ForwardBackwardReverseKLRequest) -> types.UntypedAPIFuture:
        def check(model: TrainingModel) -> Any:
            # Every refusal happens in here, so that a refused request still gives up its seq_id.
            reference: AdapterSource | None = None
            if is_checkpoint_path(req.reference_model_path):
                reference = self.sources.read_source(req.reference_model_path, p.owner)
            else:
                self.sources.check_base_model(req.reference_model_path, "reference_model_path")
            job = self.engine.prepare_reverse_kl(_datums(req), req.temperature, reference)

            async def run() -> ForwardBackwardReverseKLResponse:
                out = await self.work.call(self.engine.submit(job.on(model.adapter())))
                return ForwardBackwardReverseKLResponse(
                    outputs=[ReverseKLItemOutput(loss=WireTensor(**tensor_json(_loss_of(o)))) for o in out.loss_fn_outputs],
                    metrics=dict(out.metrics),
                )

            return run

        return self.training.sequenced(p, req.model_id, req.seq_id, "forward_backward_reverse_kl", check)

    def interpolate(self, p: Principal, req: InterpolateCheckpointsRequest) -> types.UntypedAPIFuture:
        if not req.source_paths:
            raise InvalidInput("source_paths: at least one checkpoint is required")
        if len(req.coefficients) != len(req.source_paths):
            raise InvalidInput(
                f"coefficients has {len(req.coefficients)} entries but source_paths has {len(req.source_paths)}"
            )
        if not all(math.isfinite(c) for c in req.coefficients):
            raise InvalidInput("coefficients must be finite")
        if parse_policy_ref(req.source_paths[0]) is not None:
            raise InvalidInput("the first source path must be a checkpoint of one of your runs: the result is saved in its run")
        first_rec, first_run = self.sources.resolve(req.source_paths[0], p.owner)
        if first_run.owner != p.owner:
            raise InvalidInput("the first source path must be one of your own checkpoints: the result is saved in its run")
        name = check_name(req.output_path or f"interpolated-{int(time.time() * 1000)}", "output_path")
        out_ref = CheckpointRef(first_run.run_id, "sampler_weights", name)
        if self.stores.runs.exists(out_ref):
            raise InvalidInput(f"checkpoint {out_ref.tinker_path!r} already exists")
        # Later sources may be policy revisions too (tinker://NAME@prod).
        specs = [self.sources.source_of(first_rec, first_run)]
        specs += [self.sources.read_source(path, p.owner) for path in req.source_paths[1:]]

        async def run() -> InterpolateCheckpointsResponse:
            merged = await self.work.call(self.engine.interpolate(specs, list(req.coefficients)))
            try:
                await self.training.save_checkpoint(
                    p.owner, out_ref, None, None, lambda dest: self.work.call(self.engine.export_peft(merged, dest))
                )
            finally:
                await asyncio.wrap_future(self.engine.release_adapter(merged))
            return InterpolateCheckpointsResponse(
                path=out_ref.tinker_path, source_paths=list(req.source_paths), coefficients=list(req.coefficients)
            )

        with self.admission.enter(p.owner) as ticket:
            return self.work.register(ticket, "interpolate_checkpoints", self.work.spawn(run()))


def _loss_of(output: dict[str, types.TensorData]) -> types.TensorData:
    if "loss" in output:
        return output["loss"]
    if output:  # an engine naming its per-token values differently still answers something useful
        return next(iter(output.values()))
    return types.TensorData(data=np.zeros(0, dtype=np.float32), dtype="float32", shape=[0])
