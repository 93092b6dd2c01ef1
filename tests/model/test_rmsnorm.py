"""RMSNorm: the fused op (inference, MINT_KERNELS=fast) and the autograd form training uses both
equal a float64 reference, values and gradients. Training deliberately runs the plain form: the
fused op's backward measured slower (commit bb6ba35); this holds the two paths to the same numbers."""

import pytest
import torch

from mint_server.model import kernels
from mint_server.model.transformer import RMSNorm
from tests.tolerance import Tolerance

DIM, EPS = 96, 1e-5


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return w.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("mode", kernels.MODES)
def test_rmsnorm_values_and_grads_equal_a_float64_reference(mode):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(DIM, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(DIM, generator=g))
    x = 3 * torch.randn(4, 7, DIM, generator=g)
    tol = Tolerance(n=DIM)
    with kernels.use(mode):
        with torch.no_grad():
            inference = norm(x)
        xg = x.clone().requires_grad_(True)
        trained = norm(xg)
        upstream = torch.randn(trained.shape, generator=g)
        (trained * upstream).sum().backward()
    expected = _reference(x, norm.weight.detach())
    tol.check(inference, expected, "inference forward")
    tol.check(trained, expected, "training forward")
    x64 = x.double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    (_reference(x64, w64) * upstream.double()).sum().backward()
    tol.check_rel(xg.grad.double(), x64.grad, "grad x")
    tol.check_rel(norm.weight.grad.double(), w64.grad, "grad weight")
