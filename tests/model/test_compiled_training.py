"""The compiled training blocks (model/compiled_training.py) against the eager ones: loss and LoRA
gradients within the tolerance policy (docs/numerics.md) on the tiny configs, padded rows of mixed
adapters and packed rows; the batch-invariant mode and the families it does not cover stay eager
(bitwise the eager result), each with its reason counted."""

from __future__ import annotations

import pytest
import torch

from mint_server.engine.training_lora import TokenLora
from mint_server.model import compiled_training, invariant
from mint_server.model.loader import load_model
from mint_server.model.lora import ATTN_TARGETS, MLP_TARGETS, LoraBatch, PerLayer, target_shapes
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import for_model

TARGETS = ATTN_TARGETS + MLP_TARGETS + ("lm_head",)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def family_model(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tie=False)
    model = load_model(path, device="cpu", dtype=torch.float32)
    model.requires_grad_(False)
    return request.param, model


def lora_leaves(model, adapters: int, rank: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t, (L, fi, fo) in target_shapes(model.config).items():
        if t in TARGETS:
            out[t] = ((torch.randn(adapters, L, rank, fi, generator=g) * 0.1).requires_grad_(),
                      (torch.randn(adapters, L, fo, rank, generator=g) * 0.1).requires_grad_())
    return out


def loss_and_grads(model, weights, run) -> tuple[torch.Tensor, dict]:
    """run(weights) → logits; the loss is a fixed weighting of them, so every LoRA factor gets a gradient."""
    for a, b in weights.values():
        a.grad = b.grad = None
    logits = run(weights)
    w = torch.linspace(-1, 1, logits.numel()).view_as(logits)
    loss = (logits * w).sum()
    loss.backward()
    return loss.detach(), {t: (a.grad.clone(), b.grad.clone()) for t, (a, b) in weights.items()}


def padded(model, tokens, rows, scale):
    # two adapters and a base row; the first block recomputed in backward (checkpointed)
    return lambda w: model.logits(model.hidden_states(tokens, lora=LoraBatch(w, rows, scale), recomputed_blocks=1),
                                  LoraBatch(w, rows, scale))


def packed(model, tokens, lengths, token_rows, scale):
    # one packed row of three datums (adapters 1, 0, base): per-token adapters, per-datum attention
    def run(w):
        lora = LoraBatch(w, torch.zeros(1, dtype=torch.long), scale)  # the lm_head's LoRA: adapter 0
        return model.logits(model.packed_hidden_states(tokens, lengths, TokenLora(w, token_rows, scale)), lora)

    return run


def check_same(model, family, eager, compiled, exact: bool) -> None:
    tol = for_model(model.config)
    (l0, g0), (l1, g1) = eager, compiled
    if exact:
        assert torch.equal(l0, l1), family
    tol.check(l1, l0, f"{family} loss")
    for t in g0:
        for i in range(2):
            if exact:
                assert torch.equal(g0[t][i], g1[t][i]), (family, t, i)
            tol.check_rel(g1[t][i], g0[t][i], f"{family} {t} grad {'AB'[i]}")


@pytest.mark.parametrize("compiles", [pytest.param(True, marks=pytest.mark.slow), False])
def test_compiled_blocks_match_eager_loss_and_lora_grads(family_model, compiles):
    """compiles: the dense families (their first compile takes a minute on 2 cores: slow); False:
    the family that stays eager."""
    family, model = family_model
    if compiles != (family != "qwen3_moe"):
        pytest.skip("the other parametrisation covers this family")
    cfg = model.config
    weights = lora_leaves(model, adapters=2, rank=4, seed=1)
    scale = torch.tensor([2.0, 0.5])
    tokens = torch.randint(0, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([1, 0, -1])
    lengths = [6, 9, 5]
    flat = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    token_rows = torch.tensor([1] * 6 + [0] * 9 + [-1] * 5)
    cases = [padded(model, tokens, rows, scale), packed(model, flat, lengths, token_rows, scale)]
    model.training_graph = None
    eager = [loss_and_grads(model, weights, run) for run in cases]
    stats: dict[str, int] = {}
    graph = compiled_training.attach(model, "auto", stats, background=False)
    try:
        compiled = [loss_and_grads(model, weights, run) for run in cases]
    finally:
        model.training_graph = None
    dense = family != "qwen3_moe"
    assert stats["compiled_passes"] == (2 if dense else 0) and stats["compile_failures"] == 0, stats
    assert stats["eager_passes"] == (0 if dense else 2), stats
    if not dense:
        assert graph.eager_reason(tokens[..., None].float(), None, None, None) == "mixture-of-experts layers"
    for e, c in zip(eager, compiled, strict=True):
        check_same(model, family, e, c, exact=not dense)


def test_batch_invariant_mode_stays_eager_and_bitwise(family_model):
    family, model = family_model
    if family == "qwen3_moe":
        pytest.skip("batch-invariant mode covers dense families")
    weights = lora_leaves(model, adapters=2, rank=4, seed=4)
    scale = torch.tensor([1.0, 3.0])
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    run = padded(model, tokens, torch.tensor([0, 1]), scale)
    with invariant.use(True):
        model.training_graph = None
        eager = loss_and_grads(model, weights, run)
        stats: dict[str, int] = {}
        compiled_training.attach(model, "auto", stats, background=False)
        try:
            again = loss_and_grads(model, weights, run)
        finally:
            model.training_graph = None
    assert stats["compiled_passes"] == 0 and stats["eager_passes"] == 1, stats
    check_same(model, family, eager, again, exact=True)


def test_compile_off_counts_every_pass_eager(family_model):
    _, model = family_model
    stats: dict[str, int] = {}
    graph = compiled_training.attach(model, "off", stats)
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    finally:
        model.training_graph = None
    assert graph.eager_reason(torch.zeros(1, 3, 1), None, None, None) == "compile off"
    assert stats == {"compiled_passes": 0, "eager_passes": 1, "compile_graphs": 0, "compile_recompiles": 0,
                     "compile_failures": 0}


@pytest.mark.slow
def test_the_background_warm_up_covers_a_packed_training_pass(tmp_path):
    """Passes run eagerly ("compiling") until the warm-up is done, then compiled with no graph
    compiled again (no recompile) for packed rows of other lengths, adapters and rank, with and
    without autograd (the trainer's LoRA: per-layer leaves, engine/training_lora.py)."""
    model = load_model(make_tiny_checkpoint(tmp_path, "llama", tie=False), device="cpu", dtype=torch.float32)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(6)
    weights = {t: (PerLayer([(torch.randn(2, 4, fi, generator=g) * 0.1).requires_grad_() for _ in range(L)]),
                   PerLayer([(torch.randn(2, fo, 4, generator=g) * 0.1).requires_grad_() for _ in range(L)]))
               for t, (L, fi, fo) in target_shapes(model.config).items() if t in TARGETS}
    flat = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(7))
    by_token = packed(model, flat, [7, 4], torch.tensor([1] * 7 + [0] * 4), torch.tensor([1.0, 2.0]))
    stats: dict[str, int] = {}
    graph = compiled_training.attach(model, "auto", stats)
    assert graph.warming is not None
    graph.warming.join()
    graphs = stats["compile_graphs"]
    by_token(weights).sum().backward()
    with torch.no_grad():
        by_token(weights)
    model.training_graph = None
    assert stats["compiled_passes"] == 2 and stats["compile_failures"] == 0, stats
    assert stats["compile_graphs"] == graphs and stats["compile_recompiles"] == 0, stats
