"""The custom-loss graph interpreter: what runs, and what is refused at run time by its bounds."""

from __future__ import annotations

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from mint_server.engine.custom_loss import CustomLossError, compile_loss


def _compile(fn, ranks):
    handle = trace_loss(fn, ranks, "s")
    return handle, compile_loss(handle.name, [(i.name, i.rank) for i in handle.inputs], encode_graph(handle).nodes)


def test_rebuilt_graph_equals_the_traced_one_with_gradients():
    def loss(logprobs, advantages):
        ratio = torch.exp(logprobs - logprobs.detach())
        out = -(torch.clamp(ratio, 0.8, 1.2) * advantages).sum() + torch.nn.functional.softplus(logprobs).mean()
        return out, {"custom/n:sum": logprobs.shape[0] + 0 * out}

    handle, compiled = _compile(loss, {"logprobs": 1, "advantages": 1})
    lp, adv = torch.randn(7), torch.randn(7)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ref_loss, ref_metrics = handle.graph(a, adv)
    got_loss, got_metrics = compiled(b, adv)
    ref_loss.backward()
    got_loss.backward()
    assert torch.equal(ref_loss, got_loss) and torch.equal(a.grad, b.grad)
    assert float(got_metrics["custom/n:sum"].detach()) == 7


def test_run_time_bounds():
    def outer(logprobs):
        big = logprobs.unsqueeze(0) * logprobs.unsqueeze(1)
        return big.sum(), {}

    _, compiled = _compile(outer, {"logprobs": 1})
    assert compiled(torch.randn(100))[0].ndim == 0
    with pytest.raises(CustomLossError, match="elements"):
        compiled(torch.randn(5000))  # 25M elements: refused before it is computed

    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
        {"op": "call_function", "name": "s", "target": "operator.mul", "args": ["ab", 10**9], "kwargs": {}},
        {"op": "call_method", "name": "loss", "target": "sum", "args": [{"ref": "logprobs"}], "kwargs": {}},
        {"op": "output", "name": "output", "target": "output",
         "args": [{"tuple": [{"ref": "loss"}, {"dict": {}}]}], "kwargs": {}},
    ]

    class N:
        def __init__(self, d):
            self.__dict__.update(d)

    compiled = compile_loss("s", [("logprobs", 1)], [N(n) for n in nodes])
    with pytest.raises(CustomLossError, match="operators only combine tensors and numbers"):
        compiled(torch.randn(3))
    nodes[1]["args"] = [2, 10**6]
    nodes[1]["target"] = "operator.pow"
    with pytest.raises(CustomLossError, match="exponents"):
        compile_loss("s", [("logprobs", 1)], [N(n) for n in nodes])(torch.randn(3))
