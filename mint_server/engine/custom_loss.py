"""Server-side custom losses: rebuild a client's traced torch.fx graph from an allowlist, run it per datum.

`ServiceClient.create_custom_loss` uploads a `CustomLossGraph`: the nodes of a torch.fx trace as
plain data (names, qualified function names, encoded arguments). That is untrusted input, and this
module is the security boundary for it:

* nothing is ever imported, looked up by name in a module, `eval`ed or `exec`ed: every function a
  node may call comes from the fixed tables below, built at import time from our own names;
* `getattr` nodes may only read a few harmless tensor attributes (`shape`, `ndim`, …), and method
  calls only a fixed set of `torch.Tensor` methods, on a receiver that is a tensor at run time;
* Python operators (`operator.mul`, `operator.pow`, …) only combine tensors and numbers — never
  strings, lists or tuples, which `*` would replicate — and integer results stay 64-bit;
* the graph is bounded (node count, argument nesting, references only to earlier nodes) and so is
  every value it produces (elements per tensor), so a graph cannot ask for unbounded memory;
* no function in the tables creates a tensor from a size (`zeros`, `full`, `expand`, `repeat`, `pad`
  are absent), reads or writes files, or reaches the network.

A graph is checked whole before anything runs (`compile_loss`), and a refused graph leaves nothing
behind. The compiled loss is an interpreter over its checked node list, not generated Python code.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mint_server.engine.values import EngineError

MAX_NODES = 512
MAX_ARG_DEPTH = 8
MAX_ARG_ITEMS = 256  # encoded values in one node's arguments
MAX_INPUTS = 16
MAX_ELEMENTS = 1 << 24  # per tensor a node produces
MAX_INT = 1 << 63
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")


class CustomLossError(EngineError):
    """A graph refused at upload, or a loss that failed on some datum; the message names the node."""


# --- the allowlist ---------------------------------------------------------------------------------
_TORCH = (
    "abs", "add", "all", "amax", "amin", "any", "argmax", "argmin", "cat", "clamp", "clamp_max",
    "clamp_min", "clip", "cos", "cumsum", "detach", "div", "eq", "exp", "exp2", "expm1",
    "flatten", "gather", "ge", "gt", "isfinite", "isnan", "le", "log", "log10", "log1p", "log2",
    "log_softmax", "logaddexp", "logical_and", "logical_not", "logical_or", "logsumexp", "lt", "masked_fill", "max", "maximum", "mean", "min", "minimum", "mul", "nan_to_num", "ne", "neg", "norm",
    "ones_like", "pow", "prod", "reciprocal", "relu", "rsqrt", "sigmoid", "sign", "sin", "softmax", "sort",
    "sqrt", "square", "squeeze", "stack", "std", "sub", "sum", "take_along_dim", "tanh", "topk",
    "transpose", "true_divide", "unsqueeze", "var", "where", "zeros_like", "full_like", "numel",
)
_FUNCTIONAL = (
    "relu", "softplus", "logsigmoid", "sigmoid", "log_softmax", "softmax", "silu", "gelu", "elu",
    "leaky_relu", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
    "kl_div", "normalize", "cosine_similarity", "hardtanh",
)
_MATH = ("exp", "log", "log1p", "expm1", "sqrt", "tanh", "isfinite", "fabs")
_OPERATOR = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "lt", "le", "gt", "ge",
    "eq", "ne", "and_", "or_", "xor", "invert", "not_", "getitem",
)
# fx records some functionals under their C binding's name.
_C_NN = {"softplus": F.softplus, "elu": F.elu, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh,
         "gelu": F.gelu, "silu": F.silu, "l1_loss": F.l1_loss, "mse_loss": F.mse_loss,
         "smooth_l1_loss": F.smooth_l1_loss, "huber_loss": F.huber_loss}

FUNCTIONS: dict[str, Any] = {
    **{f"torch.{n}": getattr(torch, n) for n in _TORCH},
    **{f"torch.nn.functional.{n}": getattr(F, n) for n in _FUNCTIONAL},
    **{f"torch._C._nn.{n}": fn for n, fn in _C_NN.items()},
    **{f"math.{n}": getattr(math, n) for n in _MATH},
    **{f"operator.{n}": getattr(operator, n) for n in _OPERATOR},
}
_NUMERIC_OPERATORS = {FUNCTIONS[f"operator.{n}"] for n in _OPERATOR if n != "getitem"}
METHODS = frozenset({
    "abs", "add", "all", "amax", "amin", "any", "argmax", "argmin", "bool", "clamp", "clamp_max", "clamp_min",
    "clip", "cos", "cumsum", "detach", "dim", "div", "double", "eq", "exp", "expm1", "flatten", "float", "gather",
    "ge", "gt", "isfinite", "isnan", "le", "log", "log1p", "log_softmax", "logical_not", "logsumexp", "long",
    "lt", "masked_fill", "max", "maximum", "mean", "min", "minimum", "mul", "ne", "neg", "norm",
    "numel", "pow", "prod", "reciprocal", "relu", "reshape", "rsqrt", "sigmoid", "sign", "sin", "size",
    "softmax", "sort", "sqrt", "square", "squeeze", "std", "sub", "sum", "t", "tanh", "topk", "transpose",
    "unsqueeze", "var", "view", "view_as", "where", "int",
})
ATTRIBUTES = frozenset({"shape", "ndim", "T", "mT", "dtype"})
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
           "bool": torch.bool}


# --- compiled form ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Step:
    name: str
    kind: str  # "function" | "method" | "getattr"
    fn: Any  # the callable (function), or the method/attribute name
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class CompiledLoss:
    """A checked custom loss: inputs (logprobs first) with ranks, and the steps to run."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    steps: tuple[_Step, ...]
    loss: Any  # encoded output: a _Ref
    metrics: Mapping[str, _Ref]

    def __call__(self, *values: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        env: dict[str, Any] = dict(zip((n for n, _ in self.inputs), values, strict=True))
        for step in self.steps:
            args = tuple(_resolve(a, env) for a in step.args)
            kwargs = {k: _resolve(v, env) for k, v in step.kwargs.items()}
            try:
                env[step.name] = _bounded(_run(step, args, kwargs), step.name)
            except CustomLossError:
                raise
            except Exception as e:  # a shape mismatch, a domain error, …: the user's loss is wrong
                raise CustomLossError(f"custom loss {self.name!r} failed at node {step.name!r}: {e}") from None
        loss = env[self.loss.name]
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise CustomLossError(f"custom loss {self.name!r} must return a scalar loss tensor, got {shape}")
        metrics = {}
        for key, ref in self.metrics.items():
            value = env[ref.name]
            if not isinstance(value, Tensor) or value.numel() != 1:
                raise CustomLossError(f"custom loss {self.name!r}: metric {key!r} is not a scalar tensor")
            metrics[key] = value
        return loss, metrics


def _run(step: _Step, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _check_broadcast(step, args)
    if step.kind == "getattr":
        if not isinstance(args[0], Tensor):
            raise CustomLossError(f"node {step.name!r}: attributes may only be read from tensors")
        return getattr(args[0], step.fn)
    if step.kind == "method":
        if not args or not isinstance(args[0], Tensor):
            raise CustomLossError(f"node {step.name!r}: method {step.fn!r} called on a non-tensor")
        return getattr(args[0], step.fn)(*args[1:], **kwargs)
    if step.fn in _NUMERIC_OPERATORS:
        _check_operands(step, args)
    elif step.fn is operator.getitem:
        _check_getitem(step, args)
    return step.fn(*args, **kwargs)


def _check_broadcast(step: _Step, args: tuple[Any, ...]) -> None:
    """Elementwise ops on several tensors produce their broadcast shape: bound it before computing."""
    shapes = [a.shape for a in args if isinstance(a, Tensor)]
    if len(shapes) < 2:
        return
    try:
        shape = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return  # not an elementwise op (cat, stack, …) or a mismatch the op itself reports
    if math.prod(shape) > MAX_ELEMENTS:
        raise CustomLossError(f"node {step.name!r} would produce {math.prod(shape)} elements (at most {MAX_ELEMENTS})")


def _check_operands(step: _Step, args: tuple[Any, ...]) -> None:
    for a in args:
        if not isinstance(a, Tensor | bool | int | float):
            raise CustomLossError(f"node {step.name!r}: operators only combine tensors and numbers, "
                                  f"not {type(a).__name__}")
    if (step.fn is operator.pow and all(isinstance(a, int) and not isinstance(a, bool) for a in args)
            and not 0 <= args[1] <= 64):
        raise CustomLossError(f"node {step.name!r}: integer powers take exponents in 0..64")


def _check_getitem(step: _Step, args: tuple[Any, ...]) -> None:
    if len(args) != 2 or not isinstance(args[0], Tensor | torch.Size | tuple | list):
        raise CustomLossError(f"node {step.name!r}: indexing only applies to tensors, shapes and tuples")


def _bounded(value: Any, name: str, depth: int = 0) -> Any:
    """Refuse values a loss has no business producing: huge tensors, huge ints, strings, objects."""
    if isinstance(value, Tensor):
        if value.numel() > MAX_ELEMENTS:
            raise CustomLossError(f"node {name!r} produced {value.numel()} elements (at most {MAX_ELEMENTS})")
        return value
    if isinstance(value, bool | float | torch.dtype) or value is None:
        return value
    if isinstance(value, int):
        if abs(value) >= MAX_INT:
            raise CustomLossError(f"node {name!r} produced an integer beyond 64 bits")
        return value
    if isinstance(value, tuple | list) and depth < 2 and len(value) <= MAX_ARG_ITEMS:  # shapes, topk/sort
        for v in value:
            _bounded(v, name, depth + 1)
        return value
    raise CustomLossError(f"node {name!r} produced a {type(value).__name__}, which a loss may not hold")


def _resolve(arg: Any, env: dict[str, Any]) -> Any:
    if isinstance(arg, _Ref):
        return env[arg.name]
    if isinstance(arg, list):
        return [_resolve(a, env) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_resolve(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: _resolve(v, env) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(_resolve(arg.start, env), _resolve(arg.stop, env), _resolve(arg.step, env))
    return arg


# --- checking and rebuilding -----------------------------------------------------------------------
def compile_loss(name: str, inputs: Sequence[tuple[str, int]], nodes: Sequence[Any]) -> CompiledLoss:
    """Check an uploaded graph against the allowlist and bounds; CustomLossError names what is refused.

    `nodes` are CustomLossNode-like objects (op, name, target, args, kwargs). Nothing runs here.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CustomLossError(f"name: {name!r} is not a plain identifier")
    inputs = tuple((str(n), int(r)) for n, r in inputs)
    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise CustomLossError(f"inputs: a custom loss takes 1..{MAX_INPUTS} inputs, logprobs first")
    if inputs[0][0] != "logprobs" or inputs[0][1] not in (1, 2):
        raise CustomLossError("inputs[0]: the first input must be logprobs, of rank 1 or 2")
    seen_inputs = set()
    for i, (n, r) in enumerate(inputs):
        if not _INPUT_NAME.fullmatch(n) or n in seen_inputs or r not in (0, 1, 2):
            raise CustomLossError(f"inputs[{i}]: {n!r} (rank {r}) is not a distinct lowercase name of rank 0, 1 or 2")
        seen_inputs.add(n)
    if not nodes:
        raise CustomLossError("graph.nodes: empty graph")
    if len(nodes) > MAX_NODES:
        raise CustomLossError(f"graph.nodes: {len(nodes)} nodes, at most {MAX_NODES}")

    defined: set[str] = set()
    steps: list[_Step] = []
    output: Any = None
    for i, node in enumerate(nodes):
        where = f"graph.nodes[{i}]"
        op, node_name, target = node.op, node.name, node.target
        if not isinstance(node_name, str) or not _NAME.fullmatch(node_name) or node_name in defined:
            raise CustomLossError(f"{where}.name: {node_name!r} is not a new plain identifier")
        if output is not None:
            raise CustomLossError(f"{where}: nodes after the output")
        if i < len(inputs):
            if op != "placeholder" or target != inputs[i][0] or node.args or node.kwargs:
                raise CustomLossError(f"{where}: expected placeholder {inputs[i][0]!r} (inputs in order)")
            defined.add(node_name)
            continue
        if op == "placeholder":
            raise CustomLossError(f"{where}: placeholder {target!r} is not a declared input")
        budget = [MAX_ARG_ITEMS]
        args = tuple(_decode(a, defined, f"{where}.args", 0, budget) for a in node.args)
        kwargs = {}
        for k, v in dict(node.kwargs).items():
            if not isinstance(k, str) or not _NAME.fullmatch(k):
                raise CustomLossError(f"{where}.kwargs: {k!r} is not a plain keyword")
            kwargs[k] = _decode(v, defined, f"{where}.kwargs.{k}", 0, budget)
        if op == "output":
            output = _check_output(args, where)
            continue
        if op == "call_function":
            if target in ("getattr", "builtins.getattr"):
                if len(args) != 2 or not isinstance(args[0], _Ref) or args[1] not in ATTRIBUTES or kwargs:
                    raise CustomLossError(f"{where}: getattr may only read {sorted(ATTRIBUTES)} of a node")
                steps.append(_Step(node_name, "getattr", args[1], (args[0],), {}))
            elif target in FUNCTIONS:
                steps.append(_Step(node_name, "function", FUNCTIONS[target], args, kwargs))
            else:
                raise CustomLossError(f"{where}: function {target!r} is not allowed in a custom loss")
        elif op == "call_method":
            if target not in METHODS:
                raise CustomLossError(f"{where}: tensor method {target!r} is not allowed in a custom loss")
            if not args or not isinstance(args[0], _Ref):
                raise CustomLossError(f"{where}: method {target!r} must be called on a node")
            steps.append(_Step(node_name, "method", target, args, kwargs))
        else:  # get_attr, call_module: captured tensors and nn modules
            raise CustomLossError(f"{where}: op {op!r} is not allowed in a custom loss")
        defined.add(node_name)
    if output is None:
        raise CustomLossError("graph.nodes: no output node")
    loss, metrics = output
    return CompiledLoss(name, inputs, tuple(steps), loss, metrics)


def _check_output(args: tuple[Any, ...], where: str) -> tuple[_Ref, dict[str, _Ref]]:
    out = args[0] if len(args) == 1 else None
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], _Ref) and isinstance(out[1], dict)):
        raise CustomLossError(f"{where}: the output must be (loss node, {{metric key: node}})")
    for key, value in out[1].items():
        if not _METRIC_KEY.fullmatch(key) or not isinstance(value, _Ref):
            raise CustomLossError(f"{where}: metric {key!r} must be named custom/<name>:sum or :mean and be a node")
    return out[0], dict(out[1])


def _decode(arg: Any, defined: set[str], where: str, depth: int, budget: list[int]) -> Any:
    """An encoded argument → its value (a _Ref for a node); bounded in depth and size."""
    budget[0] -= 1
    if depth > MAX_ARG_DEPTH or budget[0] < 0:
        raise CustomLossError(f"{where}: arguments nested too deep or too many")
    if arg is None or isinstance(arg, bool | float):
        return arg
    if isinstance(arg, int):
        if abs(arg) >= MAX_INT:
            raise CustomLossError(f"{where}: integer constant beyond 64 bits")
        return arg
    if isinstance(arg, str):
        if len(arg) > 256:
            raise CustomLossError(f"{where}: string constant longer than 256 characters")
        return arg
    if isinstance(arg, list):
        return [_decode(a, defined, where, depth + 1, budget) for a in arg]
    if not isinstance(arg, dict) or len(arg) != 1:
        raise CustomLossError(f"{where}: unrecognised argument encoding")
    (kind, value), = arg.items()
    if kind == "ref":
        if value not in defined:
            raise CustomLossError(f"{where}: reference to {value!r}, which is not an earlier node")
        return _Ref(value)
    if kind == "tuple" and isinstance(value, list):
        return tuple(_decode(a, defined, where, depth + 1, budget) for a in value)
    if kind == "dict" and isinstance(value, dict):
        if not all(isinstance(k, str) and len(k) <= 128 for k in value):
            raise CustomLossError(f"{where}: dict keys must be short strings")
        return {k: _decode(v, defined, where, depth + 1, budget) for k, v in value.items()}
    if kind == "slice" and isinstance(value, list) and len(value) == 3:
        parts = [_decode(a, defined, where, depth + 1, budget) for a in value]
        if not all(p is None or isinstance(p, int | _Ref) and not isinstance(p, bool) for p in parts):
            raise CustomLossError(f"{where}: slice bounds must be integers, nodes or null")
        return slice(*parts)
    if kind == "ellipsis" and value is True:
        return Ellipsis
    if kind == "float" and value in ("inf", "-inf", "nan"):
        return float(value)
    if kind == "dtype" and value in _DTYPES:
        return _DTYPES[value]
    if kind == "layout" and value == "strided":
        return torch.strided
    if kind == "memory_format" and value == "contiguous_format":
        return torch.contiguous_format
    raise CustomLossError(f"{where}: argument {kind!r}={value!r} is not allowed in a custom loss")


# --- running -------------------------------------------------------------------------------------
def datum_inputs(loss: CompiledLoss, datum: Any, i: int) -> list[Tensor]:
    """The loss_fn_inputs a datum passes to `loss`, as float32/int64 tensors, checked for rank."""
    given = getattr(datum, "loss_fn_inputs", None) or {}
    if "target_tokens" not in given:
        raise CustomLossError(f"datums[{i}].loss_fn_inputs.target_tokens is required")
    out = []
    for name, rank in loss.inputs[1:]:
        if name not in given:
            raise CustomLossError(f"datums[{i}].loss_fn_inputs.{name} is required by loss {loss.name!r}")
        td = given[name]
        try:
            t = td.to_torch() if hasattr(td, "to_torch") else torch.as_tensor(td)
        except (TypeError, ValueError) as e:
            raise CustomLossError(f"datums[{i}].loss_fn_inputs.{name}: {e}") from None
        if t.ndim != rank:
            raise CustomLossError(f"datums[{i}].loss_fn_inputs.{name}: rank {t.ndim}, loss "
                                  f"{loss.name!r} declared rank {rank}")
        if t.numel() > MAX_ELEMENTS:
            raise CustomLossError(f"datums[{i}].loss_fn_inputs.{name}: too large")
        out.append(t)
    return out


def run_per_datum(
    loss: CompiledLoss, logprobs: Sequence[Tensor], inputs: Sequence[Sequence[Tensor]]
) -> tuple[Tensor, dict[str, float]]:
    """Σ over datums of the loss (autograd flows to `logprobs`), and metrics reduced by suffix."""
    total: Tensor | None = None
    sums: dict[str, float] = {}
    with torch.enable_grad():
        for lp, xs in zip(logprobs, inputs, strict=True):
            value, metrics = loss(lp, *xs)
            total = value if total is None else total + value
            for key, m in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(m.detach().reshape(()))
    assert total is not None
    n = len(logprobs)
    return total, {k: v / n if k.endswith(":mean") else v for k, v in sums.items()}
