"""Reverse KL (on-policy distillation, MinT's forward_backward_reverse_kl): the student learns the
reference's whole next-token distribution at each position, through the trainer's machinery.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tinker import types

from mint_server.engine.jobs import ReverseKLJob
from mint_server.engine.losses import KLRow
from mint_server.engine.runner import Shard, op
from mint_server.engine.training import OUTPUT_TYPE, Output, Row, Trainer
from mint_server.engine.training_lora import LoraRef, accumulate, leaf_grads, training_lora
from mint_server.model.lora import LoraBank


class ReverseKL:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def run(self, job: ReverseKLJob, reference_adapter_id: str | None) -> Output:
        """forward_backward of Σ_t w_t · KL(p_student,t ‖ p_reference,t), accumulated into the student.

        Per student position t: p = softmax(logits / temperature) over the whole vocabulary, for the
        student adapter and for the reference (another adapter, or the bare base when None), the
        exact reverse KL Σ_v p_s(v)·(log p_s(v) − log p_r(v)); gradient only into the student.
        Returns loss_fn_outputs[i]["loss"] = w_t·KL_t per position and metrics["loss:sum"].
        """
        student = self.trainer._adapter(job.adapter_id, backward=True)
        assert student is not None
        reference = self.trainer.residency.on_device(reference_adapter_id) if reference_adapter_id is not None else None
        rows, temperature = job.rows, job.temperature
        plan = self.trainer.plan([Row(0, i, max(len(r.student), len(r.reference))) for i, r in enumerate(rows)])
        out: dict[int, np.ndarray] = {}
        total = 0.0
        runner = self.trainer.residency.runner
        try:
            for mb in plan:
                batch = [rows[r.datum] for r in mb]
                # every rank runs the pass on its share; the gradients stay pending there
                el = runner.call("reverse_kl_pass", rows=batch, student=self.trainer.lora_ref(student),
                                 reference_slot=None if reference is None else reference.slot,
                                 temperature=temperature, recomputed_blocks=self._recomputed_blocks(batch))
                for r, row, e in zip(mb, batch, el, strict=True):
                    out[r.datum] = e[: len(row.student)].copy()
                    total += float(out[r.datum].sum(dtype=np.float64))
        except BaseException:
            runner.call("train_commit", keep=False)  # every rank drops the pass's gradients
            raise
        if runner.call("train_commit", keep=True):
            raise self.trainer._non_finite(student.id)
        return Output(loss_fn_output_type=OUTPUT_TYPE, metrics={"loss:sum": total},
                      loss_fn_outputs=[{"loss": types.TensorData.from_numpy(out[i])} for i in range(len(rows))])

    def _recomputed_blocks(self, rows: list[KLRow]) -> int:
        padded = len(rows) * max(len(r.student) for r in rows)  # one student's rows: nothing fused
        return self.trainer.memory_plan(padded, padded)[0]


def kl_micro_batch(model: Any, bank: LoraBank, rows: list[KLRow], student: Any, reference_slot: int | None,
                   temperature: float, dev: torch.device, dtype: torch.dtype, recomputed_blocks: int) -> tuple[np.ndarray, Any]:
    """One reverse-KL forward + backward over `rows` on one rank's model and bank (`reverse_kl_pass`):
    the per-position losses and the student's gradient leaves."""
    R = len(rows)
    Ts, Tr = max(len(r.student) for r in rows), max(len(r.reference) for r in rows)
    s_tok, r_tok = np.zeros((R, Ts), dtype=np.int64), np.zeros((R, Tr), dtype=np.int64)
    align = np.zeros((R, Ts), dtype=np.int64)  # reference position of each student position
    valid, w = np.zeros((R, Ts), dtype=np.float32), np.zeros((R, Ts), dtype=np.float32)
    for i, r in enumerate(rows):
        n, m = len(r.student), len(r.reference)
        s_tok[i, :n], r_tok[i, :m] = r.student, r.reference
        pos = np.arange(Ts) + (m - n)
        align[i] = np.clip(pos, 0, m - 1)
        valid[i, :n] = pos[:n] >= 0
        w[i, :n] = r.weights
    with torch.no_grad():
        lora_r = bank.batch([reference_slot] * R, dev) if reference_slot is not None else None
        hr = model.hidden_states(torch.from_numpy(r_tok).to(dev), lora=lora_r)
        idx = torch.from_numpy(align).to(dev)[..., None].expand(-1, -1, hr.shape[-1])
        ref_lp = torch.log_softmax(model.logits(hr.gather(1, idx), lora_r).float() / temperature, -1)
        del hr
    lora_s, leaves = training_lora(bank, [student], [0] * R, dev, dtype)
    with torch.enable_grad():
        hs = model.hidden_states(torch.from_numpy(s_tok).to(dev), lora=lora_s, recomputed_blocks=recomputed_blocks)
        s_lp = torch.log_softmax(model.logits(hs, lora_s).float() / temperature, -1)
        kl = (s_lp.exp() * (s_lp - ref_lp)).sum(-1)
        el = kl * torch.from_numpy(w * valid).to(dev)
        el.sum().backward()
    return el.detach().float().cpu().numpy(), leaves


@op
def reverse_kl_pass(sh: Shard, rows: list[Any], student: LoraRef, reference_slot: int | None, temperature: float,
                    recomputed_blocks: int) -> Any:
    """One reverse-KL micro-batch on every rank's share (the KL over the gathered logits is the same on
    every rank); the student's gradients stay pending until `train_commit`."""
    el, leaves = kl_micro_batch(sh.model, sh.bank, rows, student, reference_slot, temperature, sh.device, sh.dtype,
                                recomputed_blocks)
    accumulate(sh.pending, leaf_grads(leaves))
    return el
