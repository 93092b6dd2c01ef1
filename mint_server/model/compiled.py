"""The compiled serving step: a step's decoder layers through compiled graphs over static buffers.

Eager PyTorch runs a decode step as ~400 small ATen ops a layer, each a dispatch of a few µs, beside
matmuls that for one row are a few hundred µs a layer (docs/engine.md). `torch.compile` (inductor)
fuses the elementwise work (norms, rope, masks, softmax, SiLU·mul, residual adds, LoRA scaling)
into a few C++ / Triton kernels and leaves the products to BLAS.

Layer functions, each one graph reused by every layer (a layer's weights, its LoRA stacks and its
KV pool are inputs, so compile time does not grow with depth), and one whole-step graph:
- **decode** (`_decode_layer`), a step of decode rows only. The LoRA bank is read as it lies
  (`model/lora.py`: A [slots, r_max, in], B [slots, out, r_max] of a layer) through each row's slot
  id (`slots`, a tensor; base rows carry scale 0), so an adapter swap writes its slot in place and
  never recompiles. The paged KV pool: each row's key/value written at its flat index, a window of
  `W` positions per row read through a flat index table (`read_idx`, from the block tables),
  masked past each row's own position; no Python per row.
- **one decode row** (`_decode_step`, the most common step: a lone request): the decode layer
  unrolled over every layer, with the embedding, rope and final norm, as one graph — no call per
  layer, and fusion across layers (a layer's residual add with the next one's norm). It compiles
  ~L times longer than one layer, so only this variant is whole.
- **prefill** (`_prefill_layer`), a step with prefill chunks (beside decode rows or not; a chunk
  may start mid-prompt, after earlier chunks or a cached prefix): the step's N tokens packed back
  to back run the norms, projections, rope, KV write and MLP in the graph; attention over each
  segment's blocks and the LoRA deltas (per segment: one adapter's tokens are one product pair)
  are two opaque custom ops (`compiled_ops.py`) reading the step's segments from a per-step context,
  the eager step's own code inside them.

Sizes: on the CPU the rows, the window and the step's tokens are symbolic dimensions
(`mark_dynamic`), so any batch runs the same graph; one decode row has its own graph (size 1
specialises). On CUDA decode rows and window are padded to powers of two, a CUDA graph per bucket;
prefill runs without CUDA graphs (its ops' work follows the segments). Each graph has a variant
with LoRA and one without (a step of base rows reads no bank).

What stays eager: the logits (one large product, nothing to fuse) and, but for one decode row, the
embedding, rope's cos/sin and the final norm; steps that score the prompt or carry images, every
family whose layer is not the dense one below, tensor parallelism, and the batch-invariant mode
(its kernels are fixed-shape on purpose) — each counted by its reason.

A compile failure never fails a step: the step runs eagerly, the reason is logged once and counted.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mint_server.model import invariant, kernels
from mint_server.model.compiled_ops import StepContext, set_step
from mint_server.model.kv_cache import KVCache, RaggedView
from mint_server.model.lora import ATTN_TARGETS, MLP_TARGETS, LoraBank
from mint_server.model.transformer import MLP, Block, Transformer, signed_sin

log = logging.getLogger(__name__)

# TORCHINDUCTOR_CACHE_DIR as the process was started with it (inductor sets it itself on first use).
_OPERATOR_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
_LAYER_TARGETS = ATTN_TARGETS + MLP_TARGETS


def unsupported(model: Transformer) -> str | None:
    """Why this model's decode step cannot run compiled (None: it can)."""
    cfg = model.config
    if model.tp is not None:
        return "tensor parallel"
    if type(model) is not Transformer:
        return f"family {type(model).__name__} (its own layer kinds)"
    if getattr(model, "quantized", None):  # its graphs read fp weights; model/quantize.py runs eagerly
        return "quantized base"
    if cfg.mrope_section is not None:
        return "multimodal rope"
    for block in model.layers:
        if type(block) is not Block or type(block.mlp) is not MLP:
            return "mixture-of-experts layers"
        if block.self_attn.window or block.self_attn.sinks is not None:
            return "sliding-window or sink attention"
    if model.embed_tokens.weight.device.type == "cpu" and shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler for inductor"
    return None


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _project(x: Tensor, w: Tensor, b: Tensor | None, lora: tuple[Tensor, Tensor] | None, slots: Tensor,
             row_scale: Tensor, skinny: bool) -> Tensor:
    """x [n, in] through the base weight plus each row's own adapter (A[slot] [r, in], B[slot]
    [out, r]) as two reductions the compiler fuses with the gather of the row's A/B (no copy of
    them per row). skinny: a few rows as weight × xᵀ (kernels.linear's rule: BLAS streams the
    weight faster that way; one row is doubled, or it takes the matrix-vector path again)."""
    if skinny:
        n = x.shape[0]
        xt = torch.cat((x, x)) if n == 1 else x
        y = (w @ xt.t())[:, :n].t()
        y = y if b is None else y + b
    else:
        y = F.linear(x, w, b)
    if lora is None:
        return y
    A, B = lora
    xa = (x[:, None, :] * A[slots]).sum(-1) * row_scale[:, None]
    return y + (xa[:, None, :] * B[slots]).sum(-1)


def _project_ragged(x: Tensor, w: Tensor, b: Tensor | None, lora: tuple[Tensor, Tensor] | None) -> Tensor:
    """A prefill step's tokens through the base weight, plus their LoRA deltas from the opaque op
    (one adapter's tokens are a plain product pair there; compiled_ops.py)."""
    y = F.linear(x, w, b)
    return y if lora is None else y + torch.ops.mint.step_lora(x, *lora)


def _qkv(x: Tensor, cos: Tensor, ssin: Tensor, w: tuple[Tensor | None, ...], lora: tuple | None,
         proj: Callable[..., Tensor], heads: int, kv_heads: int, head_dim: int,
         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's queries [n, heads, D] and rotated keys / values [n, kv_heads, D] of x [n, hidden]."""
    ln1, _, wq, bq, wk, bk, wv, bv, _, _, qn, kn, _, _, _ = w
    lq, lk, lv = lora[:3] if lora is not None else (None,) * 3
    n = x.shape[0]
    h = _rms(x, ln1, eps)
    q = proj(h, wq, bq, lq).view(n, heads, head_dim)
    k = proj(h, wk, bk, lk).view(n, kv_heads, head_dim)
    v = proj(h, wv, bv, lv).view(n, kv_heads, head_dim)
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    c, s = cos[:, None], ssin[:, None]
    q = q * c + torch.cat(q.chunk(2, -1)[::-1], -1) * s
    k = k * c + torch.cat(k.chunk(2, -1)[::-1], -1) * s
    return q, k, v


def _out(x: Tensor, y: Tensor, w: tuple[Tensor | None, ...], lora: tuple | None, proj: Callable[..., Tensor],
         eps: float) -> Tensor:
    """The rest of the layer after attention's output y [n, heads · D]: o_proj, the residual, the MLP."""
    _, ln2, _, _, _, _, _, _, wo, bo, _, _, wg, wu, wd = w
    lo, lg, lu, ld = lora[3:] if lora is not None else (None,) * 4
    x = x + proj(y, wo, bo, lo)
    h = _rms(x, ln2, eps)
    return x + proj(F.silu(proj(h, wg, None, lg)) * proj(h, wu, None, lu), wd, None, ld)


def _make_decode_layer(heads: int, kv_heads: int, head_dim: int, eps: float) -> Callable[..., Tensor]:
    group, scale = heads // kv_heads, head_dim**-0.5

    def _decode_layer(x: Tensor, cos: Tensor, ssin: Tensor, w: tuple[Tensor | None, ...],
                      lora: tuple[tuple[Tensor, Tensor], ...] | None, slots: Tensor, row_scale: Tensor,
                      k_pool: Tensor, v_pool: Tensor, write_idx: Tensor, read_idx: Tensor, visible: Tensor,
                      skinny: bool) -> Tensor:
        """One decoder layer over n decode rows: x [n, hidden] → [n, hidden]; the row's key/value
        written at write_idx [n] of the layer's flat pools [positions, kv_heads, head_dim]; its keys
        read at read_idx [n, W] where visible [n, W]."""

        def proj(h: Tensor, wt: Tensor, b: Tensor | None, ab: tuple[Tensor, Tensor] | None) -> Tensor:
            return _project(h, wt, b, ab, slots, row_scale, skinny)

        n = x.shape[0]
        q, k, v = _qkv(x, cos, ssin, w, lora, proj, heads, kv_heads, head_dim, eps)
        k_pool.index_copy_(0, write_idx, k)
        v_pool.index_copy_(0, write_idx, v)
        keys, values = k_pool[read_idx], v_pool[read_idx]  # [n, W, kv_heads, head_dim]
        qg = q.view(n, kv_heads, group, head_dim)  # GQA: a key head's query heads as its queries
        scores = torch.einsum("nhgd,nwhd->nhgw", qg.float(), keys.float()) * scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
        y = torch.einsum("nhgw,nwhd->nhgd", scores.to(values.dtype), values).reshape(n, heads * head_dim)
        return _out(x, y, w, lora, proj, eps)

    return _decode_layer


def _rope(model: Transformer, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin [n, head_dim] of positions [n] (the eager step's values)."""
    cos, sin = model.rope(pos[:, None])  # [n, 1, 1, D]
    if model.rope_factor != 1.0:
        cos, sin = cos * model.rope_factor, sin * model.rope_factor
    return cos[:, 0, 0].to(dtype), signed_sin(sin[:, 0, 0]).to(dtype)


def _make_decode_step(model: Transformer) -> Callable[..., Tensor]:
    cfg = model.config
    layer = _make_decode_layer(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def _decode_step(tokens: Tensor, pos: Tensor, weights: list[tuple[Tensor | None, ...]],
                     loras: list[tuple[tuple[Tensor, Tensor], ...]] | None, pools: list[tuple[Tensor, Tensor]],
                     slots: Tensor, row_scale: Tensor, write_idx: Tensor, read_idx: Tensor, visible: Tensor,
                     skinny: bool) -> Tensor:
        """One decode row's whole step as one graph: the embedding, rope, every layer (unrolled) and
        the final norm → its final hidden state [1, hidden]. No call per layer, and the compiler
        fuses across layers (a layer's residual add with the next one's norm)."""
        x = model.embed_tokens(tokens)
        cos, ssin = _rope(model, pos, x.dtype)
        for i, w in enumerate(weights):
            x = layer(x, cos, ssin, w, None if loras is None else loras[i], slots, row_scale, *pools[i], write_idx,
                      read_idx, visible, skinny)
        return model.norm(x)

    return _decode_step


def _make_prefill_layer(heads: int, kv_heads: int, head_dim: int, eps: float) -> Callable[..., Tensor]:
    def _prefill_layer(x: Tensor, cos: Tensor, ssin: Tensor, w: tuple[Tensor | None, ...],
                       lora: tuple[tuple[Tensor, Tensor], ...] | None, k_pool: Tensor, v_pool: Tensor,
                       write_idx: Tensor) -> Tensor:
        """One decoder layer over a step's N tokens packed back to back (prefill chunks and decode
        rows): x [N, hidden] → [N, hidden]; keys/values written at write_idx [N], attention and the
        LoRA deltas through the opaque per-segment ops (compiled_ops.py)."""
        n = x.shape[0]
        q, k, v = _qkv(x, cos, ssin, w, lora, _project_ragged, heads, kv_heads, head_dim, eps)
        k_pool.index_copy_(0, write_idx, k)
        v_pool.index_copy_(0, write_idx, v)
        y = torch.ops.mint.ragged_attention(q, k_pool, v_pool).reshape(n, heads * head_dim)
        return _out(x, y, w, lora, _project_ragged, eps)

    return _prefill_layer


@dataclass
class CompileStats:
    """What /metrics reports of the compiled step (cumulative)."""

    compiled_steps: int = 0
    eager_steps: Counter = field(default_factory=Counter)  # reason → steps
    graphs: int = 0  # graphs compiled (the warm-up's included)
    recompiles: int = 0  # graphs compiled after the warm-up finished
    graph_breaks: int = 0
    failures: int = 0
    compile_seconds: float = 0.0

    _logged: set[str] = field(default_factory=set)

    def note_eager(self, reason: str) -> None:
        self.eager_steps[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("decode step runs eagerly: %s (logged once per reason)", reason)

    def totals(self) -> dict[str, float]:
        return {"compiled_steps": self.compiled_steps, "eager_steps": sum(self.eager_steps.values()),
                "graphs": self.graphs, "recompiles": self.recompiles, "graph_breaks": self.graph_breaks,
                "failures": self.failures, "compile_seconds": self.compile_seconds}


def configure_cache(cache_dir: Path | None) -> None:
    """Inductor's compiled kernels and FX graphs under `cache_dir` (the data dir), so a restart
    compiles warm; and a recompile past dynamo's limit raises (we fall back, counted) instead of
    silently running eager."""
    import torch._dynamo
    import torch._inductor.config

    if cache_dir is not None and _OPERATOR_CACHE_DIR is None:  # an operator's own choice stands
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    torch._inductor.config.fx_graph_cache = True
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True


class StepGraph:
    """The compiled serving step of one model, its LoRA bank and its KV cache (see the module doc)."""

    def __init__(self, model: Transformer, bank: LoraBank, cache: KVCache, stats: CompileStats,
                 buckets: bool | None = None) -> None:
        """buckets: pad decode rows and the KV window to powers of two (default: on CUDA, where each
        bucket is captured as a CUDA graph and replayed; the CPU needs no padding under dynamic sizes)."""
        self.model, self.bank, self.cache, self.stats = model, bank, cache, stats
        cuda = model.embed_tokens.weight.device.type == "cuda"
        self.buckets = cuda if buckets is None else buckets
        self._ready: set[tuple[str, bool]] = set()  # variants (step kind, LoRA) compiled: steps may use them
        self._warming = threading.local()  # set on the thread running warm_up: its compiles are expected
        self._broken: str | None = None
        self._lock = threading.Lock()
        cfg = model.config
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self._decode = torch.compile(_make_decode_layer(*shape), fullgraph=True, dynamic=None,
                                     backend=self._backend(cudagraphs=cuda))
        self._decode_one = torch.compile(_make_decode_step(model), fullgraph=True, dynamic=None,
                                         backend=self._backend(cudagraphs=cuda))
        # no CUDA graphs for prefill: its ops' work depends on the step's segments, which a replay would not see
        self._prefill = torch.compile(_make_prefill_layer(*shape), fullgraph=True, dynamic=None,
                                      backend=self._backend(cudagraphs=False))
        self._weights = [self._layer_weights(b) for b in model.layers]
        has_lora = all(t in bank.A for t in _LAYER_TARGETS) and bank.num_slots > 0
        self._lora = ([tuple((bank.A[t][:, i], bank.B[t][:, i]) for t in _LAYER_TARGETS)
                       for i in range(len(model.layers))] if has_lora else None)
        D, Hkv = cfg.head_dim, cfg.num_kv_heads
        self._pools = [(cache.k[i].view(-1, Hkv, D), cache.v[i].view(-1, Hkv, D)) for i in range(len(model.layers))]
        if cuda:  # weights, bank and pools are read (and the pools written) in place by every replay
            for t in (*[w for ws in self._weights for w in ws if w is not None],
                      *[x for layer in self._lora or () for ab in layer for x in ab],
                      *[p for kv in self._pools for p in kv]):
                torch._dynamo.mark_static_address(t)

    @staticmethod
    def _layer_weights(block: Block) -> tuple[Tensor | None, ...]:
        a, m = block.self_attn, block.mlp
        qn = a.q_norm.weight if a.qk_norm else None
        kn = a.k_norm.weight if a.qk_norm else None
        return (block.input_layernorm.weight, block.post_attention_layernorm.weight,
                a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight, a.v_proj.bias,
                a.o_proj.weight, a.o_proj.bias, qn, kn, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)

    def _backend(self, cudagraphs: bool) -> Callable[..., Any]:
        def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
            from torch._inductor.compile_fx import compile_fx

            t0 = time.perf_counter()
            compiled = compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True} if cudagraphs else None)
            self.stats.compile_seconds += time.perf_counter() - t0
            self.stats.graphs += 1
            if not getattr(self._warming, "on", False):
                self.stats.recompiles += 1
            return compiled

        return backend

    # --- warm-up --------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile every variant on dummy steps that write and read only the scratch block, the most
        used first (one decode row, on an adapter); steps use each variant once it is compiled."""
        self._warming.on = True
        try:
            for lengths, lora in self._examples():
                variant = self._variant(lengths, lora)
                if variant in self._ready:
                    continue
                n = sum(lengths)
                positions = [i for m in lengths for i in range(m)]
                self._run([0] * n, positions, lengths, [[KVCache.SCRATCH] * 2] * len(lengths),
                          [0 if lora else -1] * len(lengths))
                self._ready.add(variant)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
            self._fail(e)
        finally:
            self._warming.on = False

    @property
    def ready(self) -> bool:
        """Every variant compiled (and nothing failed)."""
        return self._broken is None and self._ready >= {self._variant(n, lora) for n, lora in self._examples()}

    def _examples(self) -> list[tuple[list[int], bool]]:
        """(segment lengths, LoRA) of a step of each variant, the most used first: one decode row (on
        an adapter, on the base), a few, many; a prefill chunk beside a decode row."""
        lora = (True, False) if self._lora is not None else (False,)
        out = [([1] * rows, on) for on in lora for rows in (1, 2, kernels.skinny_rows() + 1)]
        out += [([2, 1], on) for on in lora]
        return sorted(out, key=lambda s: (s[0] != [1], not s[1]))

    def _variant(self, lengths: list[int], lora: bool) -> tuple[str, bool]:
        """Which graph a step runs: a prefill layer if a segment is a chunk; else the decode layer for
        one row, a few (skinny products) or more (after bucketing)."""
        lora = lora and self._lora is not None
        if any(n != 1 for n in lengths):
            return "prefill", lora
        rows = _bucket(len(lengths)) if self.buckets else len(lengths)
        kind = "one" if rows == 1 else "skinny" if kernels.fast() and rows <= kernels.skinny_rows() else "wide"
        return kind, lora

    def _fail(self, e: BaseException) -> None:
        import torch._dynamo.exc as dynamo_exc

        if isinstance(e, dynamo_exc.Unsupported):
            self.stats.graph_breaks += 1
        self.stats.failures += 1
        self._broken = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        log.warning("compiled serving step disabled, running eagerly: %s", self._broken)

    # --- the step -------------------------------------------------------------------------------
    def eager_reason(self, lengths: list[int], slots: list[int], scoring: bool, images: bool) -> str | None:
        """Why this step runs eagerly (None: it runs compiled)."""
        if self._broken is not None:
            return "compile failed"
        if invariant.enabled():
            return "batch-invariant mode"
        if scoring:
            return "prompt scoring"
        if images:
            return "images"
        if self._variant(lengths, any(s >= 0 for s in slots)) not in self._ready:
            return "compiling"
        return None

    def hidden(self, tokens: list[int], positions: list[int], lengths: list[int], tables: list[list[int]],
               slots: list[int]) -> Tensor | None:
        """Final-norm hidden states [tokens, hidden] of a step's segments packed back to back (segment
        i: lengths[i] tokens of one sequence, on its blocks tables[i] and adapter slot slots[i], -1
        the base); None if the compiled step failed (the caller runs it eagerly; the reason is counted)."""
        try:
            with self._lock:
                out = self._run(tokens, positions, lengths, tables, slots)
        except Exception as e:  # noqa: BLE001 - a compiler or runtime failure: eager from now on
            self._fail(e)
            return None
        self.stats.compiled_steps += 1
        return out

    def _run(self, tokens: list[int], positions: list[int], lengths: list[int], tables: list[list[int]],
             slots: list[int]) -> Tensor:
        if any(n != 1 for n in lengths):
            return self._run_prefill(tokens, positions, lengths, tables, slots)
        return self._run_decode(tokens, positions, tables, slots)

    def _run_prefill(self, tokens: list[int], positions: list[int], lengths: list[int], tables: list[list[int]],
                     slots: list[int]) -> Tensor:
        model, dev, bs = self.model, self.model.embed_tokens.weight.device, self.cache.block_size
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [KVCache.SCRATCH] * (width - len(t)) for t in tables], device=dev)
        pos = torch.tensor(positions, device=dev)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        view = RaggedView(self.cache, table, pos[:, None], [(a, n, i) for i, (a, n) in enumerate(zip(starts, lengths, strict=True))])
        write_idx = (view.write_block * bs + view.write_offset).flatten()
        used = [s for s in slots if s >= 0]
        use_lora = self._lora is not None and bool(used)
        lora = None
        if use_lora:
            lora = self.bank.batch([s for s, n in zip(slots, lengths, strict=True) for _ in range(n)], dev)
        set_step(StepContext(view, lora, max((self.bank.rank[s] for s in used), default=0)))
        try:
            with torch.no_grad():
                x = model.embed_tokens(torch.tensor(tokens, device=dev))
                cos, ssin = _rope(model, pos, x.dtype)
                for t in (x, cos, ssin, write_idx):
                    torch._dynamo.mark_dynamic(t, 0)
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.ready):
                    for i, w in enumerate(self._weights):
                        k_pool, v_pool = self._pools[i]
                        x = self._prefill(x, cos, ssin, w, self._lora[i] if use_lora else None, k_pool, v_pool,
                                          write_idx)
                return model.norm(x)
        finally:
            set_step(None)

    def _run_decode(self, tokens: list[int], positions: list[int], tables: list[list[int]], slots: list[int]) -> Tensor:
        model, dev = self.model, self.model.embed_tokens.weight.device
        n, bs = len(tokens), self.cache.block_size
        # the window every row reads: its blocks up to the longest row's last position (at least 2
        # positions, so it is never a size-1 dimension the compiler would specialise on)
        blocks = max(-(-(max(positions) + 1) // bs), -(-2 // bs))
        use_lora = self._lora is not None and any(s >= 0 for s in slots)
        if self.buckets:  # rows and window padded to powers of two: a CUDA graph per bucket, replayed
            rows, blocks = _bucket(n), _bucket(blocks)
            pad = rows - n  # padding rows: token 0 at position 0 on the scratch block, the base
            tokens, positions = tokens + [0] * pad, positions + [0] * pad
            tables, slots = tables + [[KVCache.SCRATCH]] * pad, slots + [-1] * pad
        pos = torch.tensor(positions, device=dev)
        table = torch.tensor([(t + [KVCache.SCRATCH] * blocks)[:blocks] for t in tables], device=dev)
        read_idx = (table[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)  # [rows, W]
        visible = torch.arange(read_idx.shape[1], device=dev)[None, :] <= pos[:, None]
        write_idx = table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        slot = torch.tensor(slots, device=dev)
        row_scale = torch.where(slot >= 0, self.bank.scale[slot.clamp(min=0)], 0.0).to(model.embed_tokens.weight.dtype)
        slot = slot.clamp(min=0)
        skinny = kernels.fast() and len(tokens) <= kernels.skinny_rows()
        tok = torch.tensor(tokens, device=dev)
        torch._dynamo.mark_dynamic(read_idx, 1)
        torch._dynamo.mark_dynamic(visible, 1)
        # Once every variant is compiled, nothing compiles again, so the per-call guards need only
        # tell the variants apart (each layer call checks ~40 tensors' guards otherwise).
        with torch.no_grad(), torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.ready):
            if len(tokens) == 1:  # the most common step: one graph for all of it
                return self._decode_one(tok, pos, self._weights, self._lora if use_lora else None, self._pools, slot,
                                        row_scale, write_idx, read_idx, visible, skinny)
            x = model.embed_tokens(tok)
            cos, ssin = _rope(model, pos, x.dtype)
            for t in (x, cos, ssin, slot, row_scale, write_idx, read_idx, visible):
                torch._dynamo.mark_dynamic(t, 0)
            for i, w in enumerate(self._weights):
                lora = self._lora[i] if use_lora else None
                k_pool, v_pool = self._pools[i]
                x = self._decode(x, cos, ssin, w, lora, slot, row_scale, k_pool, v_pool, write_idx, read_idx,
                                 visible, skinny)
            return model.norm(x[:n])


def _bucket(n: int) -> int:
    """The least power of two ≥ n."""
    return 1 << (n - 1).bit_length()
