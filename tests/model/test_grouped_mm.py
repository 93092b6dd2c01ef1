"""kernels.grouped_mm (the MoE segments' product): torch._grouped_mm path vs the per-group loop vs a
dense float64 reference, forward and backward; and group_pairs' segment bounds."""

import pytest
import torch

from mint_server.model import kernels
from mint_server.model.lora import group_pairs
from tests.tolerance import Tolerance

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
IN, OUT = 64, 48
SIZES = {  # rows per group
    "mixed": [5, 0, 17, 1, 0, 9],
    "one group": [23],
    "empty ends": [0, 12, 0, 0],
    "an empty call": [3, 0, 2, 1, 0, 0, 0, 0, 4],  # "calls" (4 groups a call): the middle call has no rows
}


def segments(sizes, device):
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def reference(x, w, sizes):
    """Each row times its group's w, as a gather: no grouping code involved."""
    group = torch.repeat_interleave(torch.arange(len(sizes), device=x.device), torch.tensor(sizes, device=x.device))
    return torch.bmm(w[group], x[:, :, None]).squeeze(-1)


def run(path, x, w, offsets, dy, monkeypatch):
    """y, dx, dw through grouped_mm on `path`: "grouped" (torch._grouped_mm forced on), "calls" (the
    same, at most 4 groups per call: the split that CUDA's 1023-group limit takes) or "loop"."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with monkeypatch.context() as m, kernels.use_grouped_devices([] if path == "loop" else [x.device.type]):
        if path == "calls":
            m.setattr(kernels, "GROUPED_MAX_GROUPS", 4)
        y = kernels.grouped_mm(x, w, offsets)
    split = path == "calls" and w.shape[0] > 4
    expected_node = {"grouped": "_GroupedMMBackward", "calls": "CatBackward0" if split else "_GroupedMMBackward",
                     "loop": "CatBackward0"}[path]
    assert type(y.grad_fn).__name__ == expected_node, (path, type(y.grad_fn).__name__)
    (y * dy).sum().backward()
    return y, x.grad, w.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", SIZES)
@pytest.mark.parametrize("path", ["grouped", "calls", "loop"])
def test_grouped_mm_matches_a_dense_reference_forward_and_backward(device, dtype, layout, path, monkeypatch):
    if device == "cuda" and dtype == torch.float32 and path != "loop":
        pytest.skip("CUDA's grouped kernel is bf16 only (fp32 takes the loop)")
    sizes = SIZES[layout]
    g = torch.Generator().manual_seed(len(sizes))
    P = sum(sizes)
    x = torch.randn(P, IN, generator=g).to(device, dtype)
    w = torch.randn(len(sizes), OUT, IN, generator=g).to(device, dtype)
    dy = torch.randn(P, OUT, generator=g).to(device, dtype)
    y, dx, dw = run(path, x, w, segments(sizes, device), dy, monkeypatch)

    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y64 = reference(x64, w64, sizes)
    (y64 * dy.double()).sum().backward()
    assert y.dtype == dtype and y.shape == (P, OUT) and dw.shape == w.shape
    Tolerance(n=IN, dtype=dtype).check(y.double(), y64, "y")
    Tolerance(n=OUT, dtype=dtype).check(dx.double(), x64.grad, "dx")
    Tolerance(n=max(P, 1), dtype=dtype).check(dw.double(), w64.grad, "dw")
    empty = [i for i, n in enumerate(sizes) if n == 0]
    assert not dw[empty].any()  # an empty group's weight gets exactly zero gradient


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_and_loop_paths_agree_on_a_transposed_weight_view(device, monkeypatch):
    """w may be a [G, out, in] view of a [G, in, out] store (column-major last dims)."""
    sizes = SIZES["mixed"]
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), IN, generator=g).to(device, dtype)
    w = torch.randn(len(sizes), IN, OUT, generator=g).to(device, dtype).transpose(1, 2)
    dy = torch.randn(sum(sizes), OUT, generator=g).to(device, dtype)
    grouped = run("grouped", x, w, segments(sizes, device), dy, monkeypatch)
    loop = run("loop", x, w, segments(sizes, device), dy, monkeypatch)
    for what, a, b, n in zip(("y", "dx", "dw"), grouped, loop, (IN, OUT, sum(sizes)), strict=True):
        Tolerance(n=n, dtype=dtype).check(a.float(), b.float(), what)


@pytest.mark.parametrize("layout", ["rows of 24 bytes", "column-major x"])
def test_a_layout_the_grouped_kernel_refuses_takes_the_loop(layout):
    """Rows of 6 float32 are not 16-byte strided; a column-major x would need other kernel variants
    (CUDA's dw refuses empty segments there): the loop runs even when forced on."""
    sizes = [3, 0, 5]
    fan_in = 6 if layout == "rows of 24 bytes" else 8
    x = torch.randn(sum(sizes), fan_in)
    if layout == "column-major x":
        x = x.t().contiguous().t()
    x.requires_grad_(True)
    w = torch.randn(len(sizes), 8, fan_in)
    with kernels.use_grouped_devices(["cpu"]):
        y = kernels.grouped_mm(x, w, segments(sizes, "cpu"))
    assert type(y.grad_fn).__name__ == "CatBackward0"
    Tolerance(n=fan_in).check(y.detach(), reference(x.detach(), w, sizes), "y")


def test_group_pairs_bounds_segments_expert_major_with_base_pairs_in_slot_zero():
    # 4 experts, 2 adapters; pairs given unsorted; -1 = a base pair
    expert = torch.tensor([2, 0, 2, 3, 0, 2, 0, 3])
    adapter = torch.tensor([1, -1, 0, 1, 1, -1, 0, 1])
    groups = group_pairs(expert, adapter, num_experts=4, num_adapters=2)
    # groups (e, slot): (0,0): 2 pairs [base, a0]; (0,1): 1; (1,*): 0; (2,0): 2 [a0, base]; (2,1): 1; (3,1): 2
    assert groups.group_offsets.dtype == torch.int32
    assert groups.group_offsets.tolist() == [2, 3, 3, 3, 5, 6, 6, 8]
    assert groups.expert_offsets.tolist() == [3, 3, 6, 8]
    assert groups.expert.tolist() == [0, 0, 0, 2, 2, 2, 3, 3]
    assert groups.adapter.tolist() == [-1, 0, 1, 0, -1, 1, 1, 1]  # stable within a group
    assert torch.equal(expert[groups.order], groups.expert) and torch.equal(adapter[groups.order], groups.adapter)
    no_lora = group_pairs(expert, torch.full_like(expert, -1), num_experts=4, num_adapters=0)
    assert no_lora.group_offsets.tolist() == no_lora.expert_offsets.tolist() == [3, 3, 6, 8]
