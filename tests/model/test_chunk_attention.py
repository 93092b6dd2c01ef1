"""Prefill chunks' attention (kernels.chunk_attention): its fast form equals one masked call."""

import pytest
import torch
import torch.nn.functional as F

from mint_server.model import kernels
from tests.tolerance import Tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "n", "prefix"), [(4, 2, 5, 11), (3, 1, 1, 40), (2, 2, 17, 1), (6, 3, 33, 64)])
def test_chunk_attention_equals_one_masked_call(dtype, heads, kv_heads, n, prefix):
    """A chunk after a prefix, as two flash calls merged by log-sum-exp (query heads folded per key
    head), gives the masked call's output: softmax over S keys in another order, so within the
    tolerance policy for a reduction over S keys and the head size."""
    g = torch.Generator().manual_seed(n * 100 + prefix)
    D, S = 8, prefix + n
    q = torch.randn(1, n, heads, D, generator=g).transpose(1, 2).to(dtype)  # the runs' strided layout
    k = torch.randn(1, S, kv_heads, D, generator=g).transpose(1, 2).to(dtype)
    v = torch.randn(1, S, kv_heads, D, generator=g).transpose(1, 2).to(dtype)
    with kernels.use("reference"):
        expected = kernels.chunk_attention(q, k, v, 0.3)
    with kernels.use("fast"), torch.no_grad():
        actual = kernels.chunk_attention(q, k, v, 0.3)
    mask = torch.arange(S)[None, :] <= torch.arange(prefix, S)[:, None]
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(heads // kv_heads, 1),
                                           v.double().repeat_interleave(heads // kv_heads, 1),
                                           attn_mask=mask[None, None], scale=0.3)
    assert actual.shape == expected.shape == (1, heads, n, D) and actual.dtype == dtype
    Tolerance(n=max(S, D), dtype=dtype).check(actual, exact, "chunk attention vs float64")
    Tolerance(n=max(S, D), dtype=dtype).check(expected, exact, "masked call vs float64")
