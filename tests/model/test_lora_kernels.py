"""The fast mixed-adapter LoRA (MixedPlan: slot-range bmm, per-adapter segments) equals the reference
per-row gather, values and gradients, for every row layout it chooses between."""

import pytest
import torch

from mint_server.model import kernels
from mint_server.model.lora import LoraBatch, add_lora, add_product
from tests.tolerance import Tolerance

LAYOUTS = {
    "distinct": ([0, 1, 2, 3, 4, 5, 6], "range"),
    "base_rows_and_repeats": ([3, -1, 0, 5, 1, 3, -1, 0], "range"),
    "grouped_in_order": ([2, 2, 3, 3], "range"),  # identity layout: no copy of x or y
    "one_heavy_adapter": ([6] * 9 + [0, 1], "segments"),
    "reversed": ([5, 4, 3, 2], "range"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tokens", [1, 3])
def test_fast_mixed_lora_equals_the_reference_gather(layout, tokens):
    rows, kind = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    n, r, fi, fo = 7, 4, 16, 24
    A, B = torch.randn(n, r, fi, generator=g), torch.randn(n, fo, r, generator=g)
    scale = torch.rand(n, generator=g)
    x, y = torch.randn(len(rows), tokens, fi, generator=g), torch.randn(len(rows), tokens, fo, generator=g)
    results = {}
    for mode in kernels.MODES:
        with kernels.use(mode):
            batch = LoraBatch({}, torch.tensor(rows), scale)
            assert (batch.plan.kind if batch.plan else None) == (kind if mode == "fast" else None)
            with torch.no_grad():
                out = add_lora(y.clone(), x, A, B, batch)
            xg, Ag, Bg = (t.clone().requires_grad_(True) for t in (x, A, B))
            add_lora(y.clone(), xg, Ag, Bg, batch).square().sum().backward()
            results[mode] = (out, xg.grad, Ag.grad, Bg.grad)
    for fast, ref in zip(results["fast"], results["reference"], strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9])
def test_skinny_products_equal_f_linear(rows):
    """kernels.linear takes few-row products as weight × xᵀ (fast kernels, outside autograd): the
    same values as F.linear within the tolerance policy, for any leading shape and with a bias; more
    rows than skinny_rows, or autograd, take F.linear itself."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g)
    b = torch.randn(48, generator=g)
    x = torch.randn(rows, 1, 40, generator=g)
    old = kernels.skinny_rows()
    try:
        kernels.set_skinny_rows(8)
        with kernels.use("fast"), torch.no_grad():
            got = kernels.linear(x, w, b)
        assert got.shape == (rows, 1, 48) and got.is_contiguous()
        Tolerance(n=40).check(got, torch.nn.functional.linear(x, w, b), f"{rows} rows")
        wg = w.clone().requires_grad_()
        with kernels.use("fast"):
            y = kernels.linear(x, wg)
        y.sum().backward()  # autograd goes through F.linear
        Tolerance(n=40).check(wg.grad, x.reshape(rows, 40).sum(0).expand(48, 40), "grad")
    finally:
        kernels.set_skinny_rows(old)


def test_skinny_calibration_picks_a_row_count():
    old = kernels.skinny_rows()
    try:
        chosen = kernels.calibrate_skinny([torch.randn(256, 128) for _ in range(4)], candidates=(1, 2, 4), repeats=1)
        assert chosen in (0, 1, 2, 4) and kernels.skinny_rows() == chosen
    finally:
        kernels.set_skinny_rows(old)


@pytest.mark.parametrize("rows", [[3, -1, 0, 5], [2, 2, 6], [1, 4, 1, 4, 0, 0, -1, 6]])
def test_a_few_mixed_rows_gather_their_weights_once_and_equal_the_reference(rows):
    """Outside autograd, at most GATHER_ROWS mixed rows take the "gather" plan: each target's A/B of
    every row is gathered once for all layers, and each layer's delta equals the reference's."""
    g = torch.Generator().manual_seed(len(rows))
    n, layers, r, fi, fo = 7, 3, 4, 16, 24
    A, B = torch.randn(n, layers, r, fi, generator=g), torch.randn(n, layers, fo, r, generator=g)
    scale = torch.rand(n, generator=g)
    x, y = torch.randn(len(rows), 1, fi, generator=g), torch.randn(len(rows), 1, fo, generator=g)
    out = {}
    for mode in kernels.MODES:
        with kernels.use(mode), torch.no_grad():
            batch = LoraBatch({"q_proj": (A, B)}, torch.tensor(rows), scale)
            assert (batch.plan.kind if batch.plan else None) == ("gather" if mode == "fast" else None)
            out[mode] = [batch.apply("q_proj", layer, x, y.clone()) for layer in range(layers)]
            assert list(batch.gathered) == (["q_proj"] if mode == "fast" else [])
    for layer in range(layers):
        Tolerance(n=fi).check(out["fast"][layer], out["reference"][layer], f"layer {layer}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_finds_every_nan_and_inf_and_no_more(dtype):
    """One sum per tensor decides the common case; a sum that overflows on finite values (3e38 × 4
    in fp32) must not be taken for an inf, and a NaN or ±inf anywhere must be found."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(64, 32, generator=g).to(dtype), torch.randn(7, generator=g).to(dtype), torch.empty(0, dtype=dtype)]
    assert kernels.all_finite(ts) and kernels.all_finite([])
    assert kernels.all_finite([torch.full((4,), 3e38, dtype=dtype), *ts])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(2):
            broken = [t.clone() for t in ts]
            broken[i].view(-1)[5] = bad
            assert not kernels.all_finite(broken)
    both = [t.clone() for t in ts]
    both[0].view(-1)[0], both[0].view(-1)[1] = float("inf"), -float("inf")  # their sum is NaN, not inf
    assert not kernels.all_finite(both)


@pytest.mark.parametrize("batched", [False, True])
def test_a_lora_delta_goes_into_the_base_output_itself_with_the_gradients_of_the_out_of_place_sum(batched):
    """add_product writes y + a @ b over y (no copy of a 49k-wide output) and autograd still gives
    every input, y's own producer included, the gradient of the plain sum."""
    g = torch.Generator().manual_seed(0)
    k, n, r, fi, fo = 3, 10, 4, 12, 20
    lead = (k, n) if batched else (k * n,)
    x, w = torch.randn(k, n, fi, generator=g), torch.randn(fo, fi, generator=g)
    a, b = torch.randn(*lead, r, generator=g), torch.randn(*lead[:-1], r, fo, generator=g)
    dy = torch.randn(k, n, fo, generator=g)
    grads = {}
    for how in ("in place", "reference"):
        xg, wg, ag, bg = (t.clone().requires_grad_(True) for t in (x, w, a, b))
        y = torch.nn.functional.linear(xg, wg)
        if how == "in place":
            out = add_product(y, ag, bg)
            assert out.data_ptr() == y.data_ptr()
        else:
            out = y + (ag @ bg).view(k, n, fo)
        (out * dy).sum().backward()
        grads[how] = (out.detach(), xg.grad, wg.grad, ag.grad, bg.grad)
    tol = Tolerance(n=max(fi, r, k * n))
    for name, ours, ref in zip(("out", "x", "w", "a", "b"), grads["in place"], grads["reference"], strict=True):
        tol.check(ours, ref, name)


def test_log_softmax_in_place_equals_torch_over_every_block_of_rows():
    vocab = 1000
    rows = 2 * ((2 << 20) // (vocab * 4)) + 7  # two whole blocks and a partial one
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4
    expected = torch.log_softmax(x, -1)
    out = kernels.log_softmax_(x.view(rows, 1, vocab))
    assert out.data_ptr() == x.data_ptr()
    Tolerance(n=vocab).check(x, expected, "log_softmax_")
