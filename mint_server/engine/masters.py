"""The fp32-master rule, in one place.

A trainable adapter on a bank of lower precision than float32 (bf16 on CUDA) keeps float32 master
copies of its weights: the optimizer updates the masters and publishes their rounding into the bank
slot, because rounding every step to bf16 would lose small updates. On a float32 bank the slot is the
master. Every writer of a slot (promote, set weights, load, the optimizer, on one rank or on each
tensor-parallel rank) asks these functions instead of restating the rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

Pairs = dict[str, tuple[Tensor, Tensor]]


def keeps_masters(trainable: bool, bank_dtype: torch.dtype) -> bool:
    return trainable and bank_dtype != torch.float32


def masters_for(pairs: Pairs, trainable: bool, bank_dtype: torch.dtype) -> Pairs | None:
    """The masters an adapter keeps after its slot was written from `pairs` (None: the slot is them)."""
    if not keeps_masters(trainable, bank_dtype):
        return None
    return {t: (x.float().clone(), y.float().clone()) for t, (x, y) in pairs.items()}


def step_params(views: Pairs, masters: Pairs | None, bank_dtype: torch.dtype) -> Pairs:
    """The float32 tensors an optimizer step updates: the slot views on a float32 bank, else masters
    that still round to what the slot holds (re-read from the slot when something else wrote it)."""
    if bank_dtype == torch.float32:
        return views
    if masters is not None and all(
        torch.equal(m.to(v.dtype), v) for t, pair in views.items() for m, v in zip(masters[t], pair, strict=True)
    ):
        return masters
    return {t: (A.float().clone(), B.float().clone()) for t, (A, B) in views.items()}


def publish(views: Pairs, params: Pairs) -> None:
    """After a step: the slot takes the masters' rounding (nothing to do when the slot is the master)."""
    with torch.no_grad():
        for t, (A, B) in views.items():
            if A.data_ptr() != params[t][0].data_ptr():
                A.copy_(params[t][0])
                B.copy_(params[t][1])
