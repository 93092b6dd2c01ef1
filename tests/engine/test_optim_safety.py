"""Optimizer state that stays sound (issue 52, item 3): a change of Adam's betas restarts the
moments (their bias correction would be wrong otherwise), and a step whose update is absurd against
the weights is refused and rolled back exactly, like a non-finite one."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from mint_server.engine import state_io
from mint_server.engine.interface import EngineError
from mint_server.engine.optim import (
    MAX_UPDATE_VS_LR,
    MAX_UPDATE_VS_WEIGHTS,
    adamw_step,
    step_or_rollback,
    update_within_bound,
)
from mint_server.engine.values import AdamState
from mint_server.model.peft_io import LoraWeights
from tests.engine.helpers import TrainRequest
from tests.engine.test_training import install_random, model, sft_datums, trainer  # noqa: F401


def _pairs(g: torch.Generator, scale: float = 1.0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {t: (torch.randn(4, 16, generator=g) * scale, torch.randn(16, 4, generator=g) * scale)
            for t in ("q_proj", "v_proj")}


def _clone(p: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {t: (a.clone(), b.clone()) for t, (a, b) in p.items()}


def test_changed_betas_restart_the_moments() -> None:
    """After three steps at (0.9, 0.999), a step at (0.99999, 0.999) — issue 52's probe — is exactly
    a fresh optimizer's first step: the old moments are not bias-corrected under the new betas."""
    g = torch.Generator().manual_seed(52)
    params, grads = _pairs(g, 0.1), [_pairs(g, 1e-3) for _ in range(4)]
    state = AdamState()
    before = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.999)
    for gr in grads[:3]:
        step_or_rollback(adamw_step, params, gr, state, before)
    assert state.step == 3 and state.betas == (0.9, 0.999)

    after = types.AdamParams(learning_rate=1e-2, beta1=0.99999, beta2=0.999)
    fresh, fresh_state = _clone(params), AdamState()
    adamw_step(fresh, grads[3], fresh_state, after)
    step_or_rollback(adamw_step, params, grads[3], state, after)
    assert state.step == 1 and state.betas == (0.99999, 0.999)
    for t in params:
        assert torch.equal(params[t][0], fresh[t][0]) and torch.equal(params[t][1], fresh[t][1])
        for m, m0 in zip(state.moments[t], fresh_state.moments[t], strict=True):
            assert torch.equal(m, m0)


def test_a_long_run_across_beta_changes_stays_bounded() -> None:
    """Betas switched back and forth mid-run: no step moves any weight by more than ~lr (the probe
    saw weights go from 0.13 to 6.2, and to 5.7e11)."""
    g = torch.Generator().manual_seed(7)
    params, state, lr = _pairs(g, 0.1), AdamState(), 1e-3
    for i in range(30):
        beta1 = (0.9, 0.99999, 0.5)[i // 10]
        old = _clone(params)
        step_or_rollback(adamw_step, params, _pairs(g, 1e-4 * (1 + i % 3)), state,
                         types.AdamParams(learning_rate=lr, beta1=beta1, beta2=0.999))
        moved = max(float((params[t][k] - old[t][k]).abs().max()) for t in params for k in (0, 1))
        assert moved <= 3 * lr, (i, moved)


def test_same_betas_keep_the_moments() -> None:
    """A changed learning rate, eps or weight decay keeps the moments and the step count."""
    g = torch.Generator().manual_seed(1)
    params, state = _pairs(g, 0.1), AdamState()
    step_or_rollback(adamw_step, params, _pairs(g, 1e-3), state, types.AdamParams(learning_rate=1e-2))
    moments = {t: tuple(m.clone() for m in ms) for t, ms in state.moments.items()}
    step_or_rollback(adamw_step, params, _pairs(g, 1e-3), state,
                     types.AdamParams(learning_rate=3e-3, eps=1e-6, weight_decay=0.01))
    assert state.step == 2
    assert any(not torch.equal(m, m0) for t in moments for m, m0 in zip(state.moments[t], moments[t], strict=True))


def test_the_bound_is_far_from_sound_steps() -> None:
    """Sound AdamW steps at learning rates up to the documented maximum stay well inside the bound."""
    g = torch.Generator().manual_seed(3)
    for lr in (1e-4, 1e-2, 1.0, 10.0):
        params, state = _pairs(g, 0.05), AdamState()
        for _ in range(5):
            old = _clone(params)
            adamw_step(params, _pairs(g, 1e-3), state, types.AdamParams(learning_rate=lr, weight_decay=0.1 / lr))
            for t in params:
                for k in (0, 1):
                    rms = lambda x: float(x.pow(2).mean().sqrt())  # noqa: E731
                    bound = MAX_UPDATE_VS_WEIGHTS * rms(old[t][k]) + MAX_UPDATE_VS_LR * lr
                    assert rms(params[t][k] - old[t][k]) < bound / 10
            assert update_within_bound(old, params, lr)


def test_an_absurd_update_is_refused_and_rolled_back_exactly(trainer) -> None:  # noqa: F811
    """Moments gone wrong (here: a first moment of 1e3 over a second of 1e-20, as from an imported
    state) make a finite but absurd update: the step is refused and weights, moments, step count and
    betas are bit-for-bit what they were. A step with new betas (fresh moments) then goes through."""
    adapter, _ = install_random(trainer)
    trainer.run([TrainRequest(adapter.id, sft_datums([9], seed=3), "cross_entropy")])
    adam = types.AdamParams(learning_rate=1e-3)
    trainer.optim_step(adapter.id, adam)  # moments exist now
    trainer.run([TrainRequest(adapter.id, sft_datums([9], seed=4), "cross_entropy")])
    for mA, vA, mB, vB in adapter.optim.moments.values():
        mA.fill_(1e3)
        mB.fill_(1e3)
        vA.fill_(1e-20)
        vB.fill_(1e-20)
    weights = {t: (a.clone(), b.clone()) for t, (a, b) in trainer.residency.weights(adapter.id).weights.items()}
    moments = {t: tuple(m.clone() for m in ms) for t, ms in adapter.optim.moments.items()}
    with pytest.raises(EngineError, match="absurd against the weights"):
        trainer.optim_step(adapter.id, adam)
    assert adapter.optim.step == 1 and adapter.optim.betas == (adam.beta1, adam.beta2) and adapter.grads
    for t, (a, b) in trainer.residency.weights(adapter.id).weights.items():  # what an export would write
        assert torch.equal(a, weights[t][0]) and torch.equal(b, weights[t][1])
    for t, ms in adapter.optim.moments.items():
        assert all(torch.equal(m, m0) for m, m0 in zip(ms, moments[t], strict=True))

    trainer.optim_step(adapter.id, types.AdamParams(learning_rate=1e-3, beta1=0.8))  # new betas: fresh moments
    assert adapter.optim.step == 1 and adapter.optim.betas == (0.8, adam.beta2)
    moved = max(float((b - weights[t][1]).abs().max())
                for t, (_, b) in trainer.residency.weights(adapter.id).weights.items())
    assert 0 < moved <= 2e-3


def test_betas_are_kept_with_a_saved_state(tmp_path) -> None:
    """Saved and loaded (or paged out and in), a state still knows its betas, so a later change is seen."""
    w = LoraWeights({"q_proj": (torch.zeros(2, 8), torch.zeros(8, 2))}, rank=2)
    optim = AdamState(3, {"q_proj": tuple(torch.ones(s) for s in ((2, 8), (2, 8), (8, 2), (8, 2)))},
                      betas=(0.9, 0.95))
    state_io.save_state(tmp_path / "s", state_io.TrainState(w, optim, "tiny/llama"))
    loaded = state_io.load_state(tmp_path / "s", include_optimizer=True).optim
    assert loaded is not None and loaded.betas == (0.9, 0.95) and loaded.step == 3
