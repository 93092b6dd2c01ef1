"""The compiled training layer: a training pass's decoder blocks as two compiled functions per layer.

Eager autograd runs a training block as ~100 ATen ops forward and as many backward, of which the
products are most of the time and the rest (RMSNorm in float32, RoPE, SiLU·mul, residual adds, the
LoRA scaling) are memory-bound elementwise passes, each writing a fresh activation and, backward,
its gradient (docs/training-speed.md). `torch.compile` (inductor, AOTAutograd) fuses those into a
few kernels forward and backward and leaves the products to BLAS; only the LoRA factors and the
hidden states get gradients (the base weights are inputs that need none).

What is static, so one pair of graphs serves every layer and every pass:
- **one pre-attention function** (norm, q/k/v with their LoRA, q/k norms, RoPE) and **one
  post-attention function** (o with its LoRA, residual, norm, the MLP with its LoRA, residual),
  reused by all layers: weights and LoRA factors are inputs, so compile time does not grow with
  depth. Attention itself stays the eager SDPA call between them (one fused op already), which is
  also how packed rows keep their per-datum attention (transformer.PackedView);
- **the pass's adapters side by side**: each target's n adapters' A as one [n·r, in] product and
  their B as one [n·r, out] product, each token keeping only its own adapter's columns, scaled
  (`keep`, [rows, 1, n·r] by row or [1, tokens, n·r] by token for a packed row); one adapter is
  exactly eager's two products. Past `WIDE_LORA_FLOPS` of extra work the pass runs eagerly;
- **dynamic sizes**: rows, tokens and adapters are symbolic, so any batch runs the same graphs.

The graphs compile in a background thread when the trainer attaches them (`attach`; passes run
eagerly meanwhile, counted as "compiling"), on a dummy packed pass with and without autograd, and
land in inductor's cache (the data dir's compile-cache/ when model/compiled.configure_cache ran).

What stays eager: the embedding, rope's cos/sin, the final norm, the logits and loss (chunked,
engine/training.py); every family whose layer is not the dense one (model/compiled.py's
`unsupported`), vision inputs, a KV cache, the batch-invariant mode (its kernels are fixed-shape on
purpose, and bitwise), the reference kernels — each counted by its reason and logged once. A
compile or runtime failure never fails a pass: it runs eagerly and the graph stays off from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from mint_server.model import invariant, kernels
from mint_server.model.lora import ATTN_TARGETS, MLP_TARGETS, LoraBatch, PerLayer
from mint_server.model.transformer import Block, PackedView, Transformer, signed_sin

log = logging.getLogger(__name__)

# A pass's extra LoRA work from running its n adapters side by side, as a fraction of the base
# products of a layer: past it the pass runs eagerly (each adapter over its own rows).
WIDE_LORA_FLOPS = 0.25

Pair = tuple[Tensor, Tensor] | None


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _project(x: Tensor, w: Tensor, b: Tensor | None, lora: Pair, keep: Tensor | None) -> Tensor:
    """x [rows, T, in] through the base weight plus the LoRA of the n adapters side by side: A
    [n, r, in] as one product, each token's own adapter's r columns kept and scaled by `keep`."""
    y = F.linear(x, w, b)
    if lora is None or keep is None:
        return y
    A, B = lora
    n, r, fan_in = A.shape
    xa = F.linear(x, A.reshape(n * r, fan_in)) * keep
    return y + F.linear(xa, B.permute(1, 0, 2).reshape(B.shape[1], n * r))


def _make_pre(heads: int, kv_heads: int, head_dim: int, eps: float) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    def pre_attention(x: Tensor, cos: Tensor, ssin: Tensor, w: tuple[Tensor | None, ...],
                      lora: tuple[Pair, Pair, Pair], keep: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """x [rows, T, hidden] → q [rows, heads, T, D], k / v [rows, kv_heads, T, D], roped."""
        ln1, wq, bq, wk, bk, wv, bv, qn, kn = w
        B, T, _ = x.shape
        h = _rms(x, ln1, eps)
        q = _project(h, wq, bq, lora[0], keep).view(B, T, heads, head_dim)
        k = _project(h, wk, bk, lora[1], keep).view(B, T, kv_heads, head_dim)
        v = _project(h, wv, bv, lora[2], keep).view(B, T, kv_heads, head_dim)
        if qn is not None:
            q, k = _rms(q, qn, eps), _rms(k, kn, eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + torch.cat(q.chunk(2, -1)[::-1], -1) * ssin
        k = k * cos + torch.cat(k.chunk(2, -1)[::-1], -1) * ssin
        return q, k, v

    return pre_attention


def _make_post(eps: float) -> Callable[..., Tensor]:
    def post_attention(x: Tensor, y: Tensor, w: tuple[Tensor | None, ...], lora: tuple[Pair, Pair, Pair, Pair],
                       keep: Tensor | None) -> Tensor:
        """x [rows, T, hidden] (the block's input), y [rows, heads, T, D] (attention) → the block's output."""
        wo, bo, ln2, wg, wu, wd = w
        B, _, T, _ = y.shape
        x = x + _project(y.transpose(1, 2).reshape(B, T, -1), wo, bo, lora[0], keep)
        h = _rms(x, ln2, eps)
        m = F.silu(_project(h, wg, None, lora[1], keep)) * _project(h, wu, None, lora[2], keep)
        return x + _project(m, wd, None, lora[3], keep)

    return post_attention


def attach(model: Transformer, compile: str, stats: dict[str, int], background: bool = True,
           start: bool = True) -> TrainingGraph:
    """Give `model`'s training passes their compiled blocks (compile "auto"), or count them eager
    with the reason (compile "off", a family or setup model/compiled.py's decode step cannot run
    either); `stats` are the trainer's counters. background: compile in a thread (passes run
    eagerly meanwhile, counted as "compiling"), started here or, start False, by `start_warm_up`
    (the engine starts it after its start-up measurements); else on the first pass that needs it."""
    from mint_server.model.compiled import unsupported

    graph = TrainingGraph(model, stats, "compile off" if compile == "off" else unsupported(model))
    model.training_graph = graph
    if background and graph._broken is None:
        graph._ready = False
        if start:
            graph.start_warm_up()
    return graph


class TrainingGraph:
    """The compiled blocks of one model's training passes (see the module doc).

    stats: the trainer's counters (they reach /metrics as mint_training{kind=...}): compiled_passes,
    eager_passes, compile_graphs (graphs compiled), compile_recompiles (of those, compiled after the
    warm-up: a pass of a kind it did not cover), compile_failures.
    """

    def __init__(self, model: Transformer, stats: dict[str, int], off: str | None = None) -> None:
        """off: why this model's passes never run compiled (compile off, its family); nothing is
        compiled then, and every pass is counted eager for it."""
        self.model, self.stats = model, stats
        for key in ("compiled_passes", "eager_passes", "compile_graphs", "compile_recompiles", "compile_failures"):
            stats.setdefault(key, 0)
        self.compile_seconds = 0.0
        self._logged: set[str] = set()
        self._broken = off
        self._lock = threading.Lock()
        self._ready = True  # False while a background warm-up compiles
        self._warmed = False
        self.warming: threading.Thread | None = None  # the background warm-up (attach)
        if off is not None:
            return
        cfg = model.config
        # Own graph caches (not shared with another model's through the functions' code), of more than
        # dynamo's default 8 graphs: the warm-up makes 6 of each. (A limit set in dynamo's config
        # would hold only on the thread that set it.)
        compile_ = dict(fullgraph=True, dynamic=True, backend=self._backend, recompile_limit=64, isolate_recompiles=True)
        self._pre = torch.compile(_make_pre(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps), **compile_)
        self._post = torch.compile(_make_post(cfg.rms_norm_eps), **compile_)
        self._weights = [self._layer_weights(b) for b in model.layers]
        base_flops = sum(p.weight.numel() for p in self._linears(model.layers[0]))
        self._lora_io = sum(p.in_features + p.out_features for p in self._linears(model.layers[0]))
        self._max_columns = int(WIDE_LORA_FLOPS * base_flops / self._lora_io)  # n·r beyond one adapter's

    def start_warm_up(self, background: bool = True) -> None:
        """Compile once: in a thread (passes run eagerly until it ends) or, background False, now."""
        if self.warming is not None or self._ready:
            return
        if not background:
            return self.warm_up()
        self.warming = threading.Thread(target=self.warm_up, name="mint-compile-training", daemon=True)
        self.warming.start()

    def warm_up(self) -> None:
        """Compile the graphs packed training passes (the dense families' path) use, forward and
        backward and forward-only: a dummy row of two datums, all on one adapter (the trainer's
        LoRA by row) and on two adapters (by token), rank 3 on every block target. (Sizes unlike
        each other, so the graphs assume no equality between them.)"""
        model, dev = self.model, self.model.embed_tokens.weight.device
        dtype, L, lengths = model.embed_tokens.weight.dtype, len(model.layers), [2, 3]
        tokens = torch.zeros(1, sum(lengths), dtype=torch.long, device=dev)
        cos, sin = model.rope(torch.tensor([[0, 1, 0, 1, 2]], device=dev))
        try:
            with self._lock:
                for n, rows in ((1, [0]), (2, [0, 0, 1, 1, 1])):
                    # per-layer tensors, as the trainer's (a view of a stack would compile other graphs)
                    weights = {t: (PerLayer([torch.zeros(n, 3, lin.in_features, device=dev, dtype=dtype,
                                                         requires_grad=True) for _ in range(L)]),
                                   PerLayer([torch.zeros(n, lin.out_features, 3, device=dev, dtype=dtype,
                                                         requires_grad=True) for _ in range(L)]))
                               for t, lin in zip(ATTN_TARGETS + MLP_TARGETS, self._linears(model.layers[0]), strict=True)}
                    lora = LoraBatch(weights, torch.tensor(rows, device=dev), torch.ones(n, device=dev))
                    for grad in (True, False):
                        with torch.set_grad_enabled(grad):
                            out = self._run(model.embed_tokens(tokens), cos.to(dtype), sin.to(dtype), lora,
                                            PackedView(lengths), 0)
                        if grad:
                            out.sum().backward()
        except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
            self._fail(e)
        self._ready = self._warmed = True

    @staticmethod
    def _linears(block: Block) -> list[torch.nn.Linear]:
        a, m = block.self_attn, block.mlp
        return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]  # type: ignore[list-item]

    @staticmethod
    def _layer_weights(block: Block) -> tuple[tuple[Tensor | None, ...], tuple[Tensor | None, ...]]:
        a, m = block.self_attn, block.mlp
        qn = a.q_norm.weight if a.qk_norm else None
        kn = a.k_norm.weight if a.qk_norm else None
        pre = (block.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
               a.v_proj.weight, a.v_proj.bias, qn, kn)
        post = (a.o_proj.weight, a.o_proj.bias, block.post_attention_layernorm.weight,
                m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)  # type: ignore[union-attr]
        return pre, post

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        t0 = time.perf_counter()
        compiled = compile_fx(gm, example_inputs)
        self.compile_seconds += time.perf_counter() - t0
        self.stats["compile_graphs"] += 1
        self.stats["compile_recompiles"] += self._warmed
        return compiled

    # --- which passes run compiled ------------------------------------------------------------
    def eager_reason(self, x: Tensor, lora: LoraBatch | None, cache: object, vision: object) -> str | None:
        """Why these blocks run eagerly (None: compiled)."""
        if self._broken is not None:
            return self._broken
        if not self._ready:
            return "compiling"
        if invariant.enabled():
            return "batch-invariant mode"
        if not kernels.fast():
            return "reference kernels"
        if self.model.tp is not None:  # sharded after attach
            return "tensor parallel"
        if vision is not None:
            return "vision input"
        if cache is not None and not isinstance(cache, PackedView):
            return "KV cache"
        if lora is not None:
            if any(t not in ATTN_TARGETS + MLP_TARGETS + ("lm_head",) for t in lora.weights):
                return "LoRA targets outside the dense layer"
            rows = lora.rows.shape[0]
            if rows != x.shape[0] and not (x.shape[0] == 1 and rows == x.shape[1]):
                return "LoRA rows that are neither the batch's rows nor its tokens"
            ab = next((ab for t, ab in lora.weights.items() if t != "lm_head"), None)
            if ab is not None:
                n, r = ab[0][:, 0].shape[:2]
                if (n - 1) * r > self._max_columns:
                    return "too many adapters in one pass for side-by-side LoRA"
        return None

    def note_eager(self, reason: str) -> None:
        self.stats["eager_passes"] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("training blocks run eagerly: %s (logged once per reason)", reason)

    # --- the pass -------------------------------------------------------------------------------
    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: PackedView | None,
                   recomputed_blocks: int) -> Tensor | None:
        """Transformer.run_layers through the compiled blocks; None if they failed (the caller runs
        the pass eagerly; from then on every pass does)."""
        try:
            with self._lock:
                out = self._run(x, cos, sin, lora, cache, recomputed_blocks)
        except Exception as e:  # noqa: BLE001 - a compiler or runtime failure: eager from now on
            self._fail(e)
            return None
        self.stats["compiled_passes"] += 1
        return out

    def _fail(self, e: BaseException) -> None:
        self._broken = "compile failed"
        self.stats["compile_failures"] += 1
        log.warning("compiled training blocks disabled, running eagerly: %s",
                    f"{type(e).__name__}: {e}".splitlines()[0][:300])

    def _run(self, x: Tensor, cos: Tensor, sin: Tensor, lora: LoraBatch | None, cache: PackedView | None,
             recomputed_blocks: int) -> Tensor:
        keep = None if lora is None else self._keep(lora, x)
        ssin = signed_sin(sin)
        for i, block in enumerate(self.model.layers):
            args = (x, cos, ssin, i, block, lora, keep, cache)
            if i < recomputed_blocks:
                x = torch.utils.checkpoint.checkpoint(self._block, *args, use_reentrant=False)
            else:
                x = self._block(*args)
        return x

    def _block(self, x: Tensor, cos: Tensor, ssin: Tensor, i: int, block: Block, lora: LoraBatch | None,
               keep: Tensor | None, cache: PackedView | None) -> Tensor:
        pre_w, post_w = self._weights[i]
        q, k, v = self._pre(x, cos, ssin, pre_w, self._pairs(lora, ATTN_TARGETS[:3], i), keep)
        attn = block.self_attn
        gqa = attn.n_heads != attn.n_kv
        if cache is not None:
            y = cache.attention(i, q, k, v, attn.head_dim**-0.5, gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
        return self._post(x, y, post_w, self._pairs(lora, ("o_proj", *MLP_TARGETS), i), keep)

    @staticmethod
    def _pairs(lora: LoraBatch | None, targets: tuple[str, ...], layer: int) -> tuple[Any, ...]:
        if lora is None:
            return (None,) * len(targets)
        out = []
        for t in targets:
            ab = lora.weights.get(t)
            out.append(None if ab is None else (ab[0][:, layer], ab[1][:, layer]))
        return tuple(out)

    @staticmethod
    def _keep(lora: LoraBatch, x: Tensor) -> Tensor | None:
        """[rows, 1, n·r] (an adapter per row) or [1, tokens, n·r] (per token, a packed row): each
        token's own adapter's scale on its r columns, 0 elsewhere (and on base tokens)."""
        ab = next((ab for t, ab in lora.weights.items() if t != "lm_head"), None)
        if ab is None:
            return None
        n, r = ab[0][:, 0].shape[:2]
        column_adapter = torch.arange(n * r, device=x.device) // r
        keep = (lora.rows[:, None] == column_adapter[None, :]).to(x.dtype) * lora.scale[column_adapter].to(x.dtype)
        return keep[:, None, :] if lora.rows.shape[0] == x.shape[0] else keep[None]
