"""An adapter's state between passes: the optimizer step (AdamW or Dimuon, on fp32 master weights),
training state on disk (save / load), PEFT export, and interpolation of adapters.

The engine worker drives it with adapters already in device slots (see residency.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tinker import types

from mint_server.engine import state_io
from mint_server.engine.jobs import OptimJob
from mint_server.engine.optim import check_family, family_named
from mint_server.engine.residency import Adapter, Residency
from mint_server.engine.state_io import check_shapes
from mint_server.engine.values import AdamState, EngineError
from mint_server.model.config import ModelConfig
from mint_server.model.lora import lora_shapes
from mint_server.model.peft_io import LoraWeights, save_peft


class AdapterState:
    """Optimizer steps, saves, loads, exports and interpolations over one residency manager."""

    def __init__(self, residency: Residency, base_model: str, cfg: ModelConfig) -> None:
        self.residency, self.base_model, self.cfg = residency, base_model, cfg

    def _adapter(self, adapter_id: str | None) -> Adapter:
        if adapter_id is None:
            raise EngineError("adapter_id: the base model is never trained")
        adapter = self.residency.on_device(adapter_id)
        if not adapter.trainable:
            raise EngineError(f"adapter_id: adapter {adapter_id!r} is sampler-only, not trainable")
        return adapter

    # --- optimizer ------------------------------------------------------------------------------
    def optim_step(self, job: OptimJob) -> types.OptimStepResponse:
        """AdamW on the gradients accumulated since the last step, then clear them.

        No accumulated gradient → no update (and the step count does not advance). A step that
        would make any weight non-finite is refused and leaves the adapter exactly as it was.
        """
        params = job.params
        a = self._adapter(job.adapter_id)
        check_family(params, a.optim.family)
        if not a.grads:
            return types.OptimStepResponse(metrics={"grad_norm:mean": 0.0, "learning_rate:mean": params.learning_rate})
        # every rank steps its share (runner.optim_step)
        return types.OptimStepResponse(metrics=self.residency.runner.call(
            "optim_step", aid=a.id, slot=a.slot, rank=a.rank, targets=a.targets, params=params))

    # --- state and weights on disk --------------------------------------------------------------
    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool = True) -> None:
        """Weights (+ AdamW moments and step) into a state dir, atomically."""
        a = self.residency.on_device(adapter_id)
        optim = self.residency.runner.call("gather_optim", aid=a.id) if include_optimizer else None
        state_io.save_state(dest, state_io.TrainState(self.residency.weights(adapter_id), optim, self.base_model))

    def load_state(self, adapter_id: str | None, src: Path, include_optimizer: bool = True,
                   optimizer: str | None = None) -> str:
        """Load a state dir into `adapter_id` (same rank and targets), or into a new trainable adapter
        when None; returns the adapter id. Pending gradients are dropped; without the optimizer the
        optimizer state restarts from step 0. A new adapter's optimizer family is the saved one
        (with the optimizer state) or `optimizer` (default "adamw"); the two must agree.
        """
        st = state_io.load_state(src, include_optimizer)
        if st.base_model != self.base_model:
            raise EngineError(f"path: state was trained on base model {st.base_model!r}, "
                              f"this engine serves {self.base_model!r}")
        check_shapes(st.weights, self.residency.bank, "path")
        if adapter_id is not None:
            family = self.residency.get(adapter_id).optim.family
        else:
            family = family_named(optimizer or (st.optim.family if st.optim else "adamw"))
        if st.optim is not None and st.optim.family != family:
            raise EngineError(f"path: the state holds {st.optim.family!r} optimizer state, this model uses "
                              f"the {family!r} optimizer (optimizer families cannot be mixed)")
        if adapter_id is None:  # the new adapter gets its optimizer state before it can be paged
            return self.residency.install(st.weights, trainable=True, optim=st.optim or AdamState(family=family)).id
        a = self.residency.on_device(adapter_id)
        if not a.trainable:
            raise EngineError(f"adapter_id: adapter {adapter_id!r} is sampler-only, not trainable")
        self.residency.set_weights(adapter_id, st.weights)
        # every rank takes its share of the loaded state (pending gradients dropped)
        self.residency.runner.call("set_optim", aid=a.id, optim=st.optim or AdamState(family=family))
        return a.id

    def export_peft(self, adapter_id: str, dest: Path) -> None:
        """Weights only, in PEFT layout (loads with peft.PeftModel.from_pretrained)."""
        save_peft(self.residency.weights(adapter_id), dest, self.base_model, self.cfg)

    # --- interpolation --------------------------------------------------------------------------
    def interpolate(self, adapter_ids: list[str], coefficients: list[float], trainable: bool = False) -> str:
        """A new adapter whose weight delta is exactly Σ cᵢ·ΔWᵢ (ΔWᵢ = sᵢ·Bᵢ·Aᵢ); returns its id.

        Ranks concatenate: A = [A₁; A₂; …], B = [c₁s₁/s·B₁, c₂s₂/s·B₂, …] with s the first source's
        scale, so the result's rank is the sum of the sources' (zero-coefficient sources are
        dropped). Sampler-only by default, like MinT's interpolate_checkpoints output.
        """
        if not adapter_ids:
            raise EngineError("adapter_ids: at least one adapter is required")
        if len(coefficients) != len(adapter_ids):
            raise EngineError(f"coefficients: {len(coefficients)} given for {len(adapter_ids)} adapters")
        for c in coefficients:
            if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c):
                raise EngineError(f"coefficients: {c!r} is not a finite number")
        pairs = [(self.residency.get(i), float(c)) for i, c in zip(adapter_ids, coefficients, strict=True)]
        if any(a.rank == 0 for a, _ in pairs):
            raise RuntimeError("interpolate: a source adapter has not been read yet")
        pairs = [(a, c) for a, c in pairs if c != 0.0] or pairs[:1]  # all zero: a zero delta of rank r₁
        rank = sum(a.rank for a, _ in pairs)
        if rank > self.residency.bank.max_rank:
            raise EngineError(f"adapter_ids: the interpolated adapter would have rank {rank} (the sum of the "
                              f"sources' ranks), above the engine's max LoRA rank {self.residency.bank.max_rank}")
        scale = pairs[0][0].scale
        sources = [(self.residency.weights(a.id), a, c) for a, c in pairs]
        shapes = self.residency.bank.full_shapes
        weights = {}
        for t in sorted({t for a, _ in pairs for t in a.targets}):
            experts = self.residency.bank.experts.get(t, 0)
            As, Bs = [], []
            for w, a, c in sources:
                a_shape, b_shape = lora_shapes(shapes[t], experts, a.rank)
                zeros = (torch.zeros(a_shape), torch.zeros(b_shape))  # weights() are on the host
                A, B = w.weights.get(t, zeros)
                As.append(A)
                Bs.append(B * (c * a.scale / scale))
            weights[t] = (torch.cat(As, dim=-2), torch.cat(Bs, dim=-1))
        out = LoraWeights(weights, rank, scale * rank)
        if out.non_finite_target() is not None:
            raise EngineError("coefficients: the interpolated weights would be non-finite; nothing was created")
        return self.residency.install(out, trainable=trainable).id
