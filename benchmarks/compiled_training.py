"""A LoRA training pass's decoder blocks: eager vs compiled vs a hand-fused LoRA autograd function,
side by side in one process (docs/training-speed.md, "Round 5").

SmolLM2-135M fp32, one rank-16 adapter on every block target, a batch of ROWS × SEQ tokens; forward
and backward of (one block | every block + the final norm) against a fixed random output gradient.
Variants, taken in turn each round (medians):

- eager: the model's own blocks (transformer.Block, LoRA through lora.add_lora);
- compiled: model/compiled_training.py (the pre- and post-attention functions under torch.compile,
  inductor; dynamic sizes; eager SDPA between them);
- fused-lora: eager blocks whose LoRA projections are one autograd function each (Unsloth's
  approach): it saves only x and the small x·Aᵀ and computes the input gradient of the base and
  the LoRA in one pass.

Beside: the blocks' FLOPs (4·N per token: forward plus input gradients of every base matmul, LoRA
and attention scores left out, as benchmarks/train.py) over the measured matmul peak.

    python -m benchmarks.compiled_training [--rows 8] [--seq 256] [--rounds 5] [--layers one all]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

import mint_server.model.transformer as transformer
from benchmarks.common import load_average, machine_floors, smollm2_dir
from mint_server.model import compiled_training
from mint_server.model.loader import load_model
from mint_server.model.lora import ATTN_TARGETS, MLP_TARGETS, LoraBatch, init_lora_weights, target_shapes

TARGETS = ATTN_TARGETS + MLP_TARGETS


class FusedLoraLinear(torch.autograd.Function):
    """y = x Wᵀ (+ b) + s·(x Aᵀ) Bᵀ, saving x and s·x Aᵀ only; W needs no gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, A: Tensor, B: Tensor, s: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xa = (x2 @ A.t()) * s
        y = torch.addmm(b, x2, w.t()) if b is not None else x2 @ w.t()
        y.addmm_(xa, B.t())
        ctx.save_for_backward(x2, xa, w, A, B)
        ctx.s, ctx.shape = s, x.shape
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple:
        x2, xa, w, A, B = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dxa = (dy2 @ B) * ctx.s  # [tokens, r]
        dx = torch.addmm(dy2 @ w, dxa, A)
        return dx.view(ctx.shape), None, None, dxa.t() @ x2, dy2.t() @ xa, None


def fused_project(linear, x, lora, target, layer, tp=None):
    ab = lora.weights.get(target) if lora is not None else None
    if ab is None:
        return transformer.F.linear(x, linear.weight, linear.bias)
    return FusedLoraLinear.apply(x, linear.weight, linear.bias, ab[0][0, layer], ab[1][0, layer], float(lora.scale[0]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", nargs="+", default=["one", "all"])
    args = ap.parse_args()

    torch.manual_seed(0)
    model = load_model(smollm2_dir(), device="cpu", dtype=torch.float32)
    model.requires_grad_(False)
    cfg = model.config
    shapes = target_shapes(cfg)
    init = init_lora_weights(shapes, TARGETS, args.rank, seed=0, dtype=torch.float32)
    weights = {t: (a[None].clone().requires_grad_(), (torch.randn_like(b) * 0.01)[None].requires_grad_())
               for t, (a, b) in init.items()}
    lora = LoraBatch(weights=weights, rows=torch.zeros(args.rows, dtype=torch.long), scale=torch.tensor([2.0]))
    tokens = torch.randint(0, cfg.vocab_size, (args.rows, args.seq))
    x0 = model.embed_tokens(tokens).requires_grad_()
    cos, sin = model.rope(torch.arange(args.seq).expand(args.rows, -1))
    stats: dict[str, int] = {}
    graph = compiled_training.TrainingGraph(model, stats)
    dout = torch.randn_like(x0)

    def pass_of(kind: str, layers: str) -> Callable[[], None]:
        def run() -> None:
            x = x0
            if layers == "one":
                if kind == "compiled":
                    out = graph._block(x, cos, signed_sin(sin), 0, model.layers[0], lora, graph._keep(lora, x), None)
                else:
                    out = model.layers[0](x, cos, sin, lora, None)
            elif kind == "compiled":
                out = model.norm(graph._run(x, cos, sin, lora, None, 0))
            else:
                out = model.norm(model.run_layers(x, cos, sin, lora, None, 0))
            out.backward(dout)

        def timed() -> None:
            project = transformer.project
            if kind == "fused-lora":
                transformer.project = fused_project
            try:
                run()
            finally:
                transformer.project = project

        return timed

    signed_sin = transformer.signed_sin
    floors = machine_floors()
    peak = floors["matmul_flop_per_s"]
    block_weights = sum(p.numel() for n, p in model.layers[0].named_parameters() if n.endswith("proj.weight"))
    print(f"machine: matmul peak {peak / 1e9:.0f} GFLOP/s fp32, read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"load average {load_average()}; {args.rows} × {args.seq} tokens, rank {args.rank}, one adapter")
    print("| blocks | eager ms | compiled ms | fused-lora ms | eager / compiled | eager / fused | "
          "compiled at % of peak | eager at % of peak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in args.layers:
        count = 1 if layers == "one" else cfg.num_layers
        flops = 4 * block_weights * count * args.rows * args.seq
        variants = {k: pass_of(k, layers) for k in ("eager", "compiled", "fused-lora")}
        t0 = time.perf_counter()
        variants["compiled"]()  # compiles (if not already)
        compile_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds + 1):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(f"| {layers} ({count}) | {med['eager'] * 1e3:.0f} | {med['compiled'] * 1e3:.0f} | "
              f"{med['fused-lora'] * 1e3:.0f} | {med['eager'] / med['compiled']:.2f} | "
              f"{med['eager'] / med['fused-lora']:.2f} | {flops / med['compiled'] / peak:.0%} | "
              f"{flops / med['eager'] / peak:.0%} |  (first compiled pass {compile_s:.1f} s)")
    print(f"graphs compiled {stats['compile_graphs']}, {graph.compile_seconds:.1f} s; load average {load_average()}")


if __name__ == "__main__":
    main()
