"""Dimuon's arithmetic: the matrix sign, and a step of Frobenius norm lr·√rank per matrix."""

from __future__ import annotations

import math

import torch
from tinker import types

from mint_server.engine.optim import dimuon_step, matrix_sign
from mint_server.engine.values import AdamState


def test_matrix_sign_is_near_orthogonal_and_batched():
    torch.manual_seed(0)
    m = torch.randn(3, 4, 64)  # [layers, r, in]: r ≪ in, like LoRA A
    s = torch.linalg.svdvals(matrix_sign(m))
    assert s.shape == (3, 4) and bool(((s > 0.6) & (s < 1.25)).all())
    tall = matrix_sign(m.mT)  # [layers, out, r], like LoRA B
    assert torch.allclose(tall, matrix_sign(m).mT)


def test_step_moves_each_matrix_by_lr_sqrt_rank_and_skips_zero_momentum():
    torch.manual_seed(1)
    A, B = torch.randn(2, 4, 32), torch.zeros(2, 16, 4)
    gA, gB = torch.zeros_like(A), torch.randn(2, 16, 4)
    params, state = {"q": (A.clone(), B.clone())}, AdamState(family="dimuon")
    hp = types.DimuonParams(learning_rate=0.01, beta1=0.9)
    dimuon_step(params, {"q": (gA, gB)}, state, hp)
    newA, newB = params["q"]
    assert torch.equal(newA, A)  # no gradient signal for A yet: unchanged
    moved = torch.linalg.matrix_norm(newB - B)
    assert torch.allclose(moved, torch.full((2,), 0.01 * math.sqrt(4)), rtol=1e-5)
    assert state.step == 1 and len(state.moments["q"]) == 2
