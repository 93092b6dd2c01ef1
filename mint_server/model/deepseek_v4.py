"""DeepSeek-V4 in our model code, with multi-LoRA built in. docs/deepseek-v4.md has the whole story.

Residual: `hc_mult` parallel streams [B, T, n, hidden]. Before the attention and before the MLP a
hyper-connection (`HyperConnection`) reads all streams and yields a `pre` mix (collapsing them into
the block's input), a `post` mix (spreading the block's output back over them) and a Sinkhorn-
normalised n × n `comb` mix of the streams themselves; the final `hc_head` collapses them once more.

Attention: q from q_a_proj → RMSNorm → q_b_proj, each head RMS-normalised; one shared K = V head
from kv_proj → RMSNorm. RoPE (interleaved pairs) on the trailing `rope_dim` of each head, and its
inverse on the output's; a learned per-head sink logit; the output through the grouped `o_a_proj`
(heads in `o_groups` groups, each projected on its own) and `o_b_proj`. The keys are the last
`sliding_window` positions plus, in CSA / HCA layers, compressed entries: every `rate` tokens a
compressor pools its window into one entry (a per-channel softmax over a gate, plus a learned
per-slot bias; CSA's windows overlap by one: an entry pools the previous window's "a" series and its
own window's "b" series), RMS-normalises it and rotates it to the window's first position. A query
sees the entries of the windows that have closed by its position; in CSA a lightning indexer (its
own, smaller compressor and heads, frozen like V3.2's) keeps only its `index_topk` best.

MoE: sqrt-softplus (or sigmoid) scores of a float32 router choose top-k experts with a
choice-only bias; the first `hash_layers` choose by a frozen token → experts table instead. The
weights are the chosen scores renormalised times `routed_scaling_factor`; the experts' and the shared
expert's SwiGLU clamp their gate and up projections at `swiglu_limit`.

Cache (sampling): see v4_spec.cache_pool_shapes. The compressor state is an online softmax (per
channel: the running log-sum-exp of the gate and the weighted mean of the values), so a window's
entry is built token by token across decode steps, or many windows at once in a prefill chunk, and
equals the entry a whole-sequence forward computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mint_server.model.config import ModelConfig
from mint_server.model.kv_cache import CacheView
from mint_server.model.lora import LoraBatch
from mint_server.model.mla_spec import rope_attention_factor
from mint_server.model.moe import SparseMoE
from mint_server.model.transformer import Transformer, project, yarn_inv_freq
from mint_server.model.v4_spec import CSA, SLIDING, V4Spec


class V4Norm(nn.Module):
    """RMSNorm with its weight in float32 and the product taken in float32 (transformers' V4 norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def unit_norm(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight (each query head; the hyper-connections' input)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def inv_freq_of(spec: V4Spec, compress: bool) -> Tensor:
    dim = spec.rope_dim
    if compress and spec.compress_rope is not None:
        return yarn_inv_freq(spec.compress_rope, dim, spec.compress_theta)
    theta = spec.compress_theta if compress else spec.main_theta
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_of(inv_freq: Tensor, positions: Tensor, factor: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [..., rope_dim / 2] (one angle per interleaved pair) of positions [...]."""
    angles = positions[..., None].float() * inv_freq.to(positions.device)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved RoPE on the trailing 2·cos.shape[-1] channels of x; cos/sin broadcast to x[..., :half]."""
    rd = 2 * cos.shape[-1]
    c, s = cos.repeat_interleave(2, -1).float(), sin.repeat_interleave(2, -1).float()
    nope, r = x[..., :-rd], x[..., -rd:]
    turned = torch.stack((-r[..., 1::2], r[..., 0::2]), -1).flatten(-2)
    return torch.cat((nope, (r.float() * c + turned.float() * s).to(x.dtype)), -1)


@dataclass
class Ctx:
    """What every layer of one forward reads: tokens and positions [B, T], both ropes' cos/sin
    [B, T, rope_dim / 2] at those positions, the compress rope (for entries' positions) and the cache."""

    tokens: Tensor
    positions: Tensor
    main: tuple[Tensor, Tensor]
    compress: tuple[Tensor, Tensor]
    compress_freq: Tensor
    compress_factor: float
    cache: CacheView | None

    def compress_rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_of(self.compress_freq, positions, self.compress_factor, dtype)


# --- online softmax states: (acc [.., d], lse [.., d]) with acc the softmax-weighted mean so far ----
def _window_state(gate: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the slot axis (dim 2) of gate [B, W, m, d], weighting value; empty windows (all
    -inf) give acc 0, lse -inf."""
    lse = torch.logsumexp(gate, dim=2)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    return (torch.exp(gate - safe[:, :, None]) * value).sum(2), lse


def _merge(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    lse = torch.logaddexp(a[1], b[1])
    safe = lse.masked_fill(torch.isinf(lse), 0.0)
    return a[0] * torch.exp(a[1] - safe) + b[0] * torch.exp(b[1] - safe), lse


def _first_only(first: tuple[Tensor, Tensor], like: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A per-window state [B, W, d] holding `first` [B, d] in window 0 and nothing in the others."""
    acc, lse = torch.zeros_like(like[0]), torch.full_like(like[1], float("-inf"))
    acc[:, 0], lse[:, 0] = first
    return acc, lse


class WindowCompressor(nn.Module):
    """Pools every `rate` tokens into one entry of `dim` channels (see the module docstring).
    overlap (CSA): kv / gate project to 2·dim, the "a" half feeding the next window's entry."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = V4Norm(dim, eps)

    def inputs(self, x: Tensor, lora: LoraBatch | None, target: str | None, index: int) -> tuple[Tensor, Tensor]:
        """kv, gate [B, T, width]; target: the LoRA target prefix (None: frozen, the indexer's)."""
        if target is None:
            return self.kv_proj(x), self.gate_proj(x)
        return (project(self.kv_proj, x, lora, target + "kv_proj", index),
                project(self.gate_proj, x, lora, target + "gate_proj", index))

    def _finish(self, pooled: Tensor, first: Tensor, ctx: Ctx, dtype: torch.dtype) -> Tensor:
        """Normalise pooled [B, W, dim] and rotate entry w to its window's first position first [B, W]."""
        cos, sin = ctx.compress_rope(first, dtype)
        return rotate(self.kv_norm(pooled.to(dtype)), cos, sin)

    def entries(self, kv: Tensor, gate: Tensor, ctx: Ctx) -> Tensor:
        """Without a cache (rows start at position 0): the entries of every complete window [B, T // rate, dim]."""
        B, T, _ = kv.shape
        m, d, n = self.rate, self.dim, kv.shape[1] // self.rate
        if n == 0:
            return kv.new_zeros(B, 0, d)
        ck = kv[:, : n * m].view(B, n, m, -1)
        cg = gate[:, : n * m].view(B, n, m, -1) + self.position_bias
        if self.overlap:  # slots: the previous window's "a" series (none before window 0), then this one's "b"
            prev_k = torch.cat((ck.new_zeros(B, 1, m, d), ck[:, :-1, :, :d]), 1)
            prev_g = torch.cat((cg.new_full((B, 1, m, d), float("-inf")), cg[:, :-1, :, :d]), 1)
            ck, cg = torch.cat((prev_k, ck[..., d:]), 2), torch.cat((prev_g, cg[..., d:]), 2)
        pooled = (ck * cg.softmax(dim=2, dtype=torch.float32).to(ck.dtype)).sum(2)
        first = (torch.arange(n, device=kv.device) * m).expand(B, n)
        return self._finish(pooled, first, ctx, kv.dtype)

    def cached_entries(self, kv: Tensor, gate: Tensor, ctx: Ctx, entry_pool: Tensor, state_pool: Tensor) -> Tensor:
        """With a cache: fold this forward's tokens into the windows' states, write the entries of the
        windows that close, and return every row's entries so far [B, W, dim] (W: the windows closed
        by the batch's last position; a row's later ones are masked by the caller).

        entry_pool [blocks, e, dim]: entry w lives in the block of its last position, slot
        (that position % block_size) // rate. state_pool [blocks, 2 or 4, dim] float32: after a
        forward, the block of each row's last position holds (acc, lse) of the window that position
        is in (and, overlapping, of its "a" series); the next forward reads it from the block of
        its first position - 1. Each row writes only blocks it owns (the sampler never writes a
        shared prompt block), so the states never mix between sequences.
        """
        view = ctx.cache
        assert view is not None
        pos, table = ctx.positions, view.table
        B, T, _ = kv.shape
        m, d, bs = self.rate, self.dim, view.cache.block_size
        dev = kv.device
        p0, p1 = pos[:, 0], pos[:, -1]
        w0 = p0 // m
        rel = pos // m - w0[:, None]  # window of each token, from the row's first
        W = int(rel.max()) + 1
        slot = pos % m
        width = kv.shape[-1]
        index = (rel * m + slot)[..., None].expand(B, T, width)
        g = torch.full((B, W * m, width), float("-inf"), device=dev).scatter(
            1, index, gate.float() + self.position_bias.float()[slot]).view(B, W, m, width)
        v = torch.zeros((B, W * m, width), device=dev).scatter(1, index, kv.float()).view(B, W, m, width)
        b_state = _window_state(g[..., -d:], v[..., -d:])  # "b" (or the only) series
        # the state before this forward: the block of position p0 - 1 (nothing at p0 == 0)
        prev_block = table.gather(1, ((p0 - 1).clamp(min=0) // bs)[:, None])[:, 0]
        prior = state_pool[prev_block]  # [B, k, d]
        has = (p0 > 0)[:, None]
        empty = torch.full_like(prior[:, 0], float("-inf"))
        zero = torch.zeros_like(prior[:, 0])
        cont = ((p0 % m) != 0)[:, None] & has  # window w0 began in an earlier forward
        if self.overlap:
            a_state = _window_state(g[..., :d], v[..., :d])
            # window w0's "a" series continues the prior's; its entry starts from the prior's own state
            # when continuing, else from the previous window's "a" series (the prior's, too)
            a0 = (torch.where(cont, prior[:, 2], zero), torch.where(cont, prior[:, 3], empty))
            a_full = _merge(_first_only(a0, a_state), a_state)
            e0 = (torch.where(cont, prior[:, 0], torch.where(has, prior[:, 2], zero)),
                  torch.where(cont, prior[:, 1], torch.where(has, prior[:, 3], empty)))
            # window w's entry starts from window w - 1's "a" series
            start = (torch.cat((e0[0][:, None], a_full[0][:, :-1]), 1), torch.cat((e0[1][:, None], a_full[1][:, :-1]), 1))
        else:
            e0 = (torch.where(cont, prior[:, 0], zero), torch.where(cont, prior[:, 1], empty))
            start = _first_only(e0, b_state)
        e_state = _merge(start, b_state)  # [B, W, d] each
        # each row's state after its last token, into the block of that token
        last = (p1 // m - w0)[:, None, None].expand(B, 1, d)
        parts = [e_state[0].gather(1, last), e_state[1].gather(1, last)]
        if self.overlap:
            parts += [a_full[0].gather(1, last), a_full[1].gather(1, last)]
        state_pool[table.gather(1, (p1 // bs)[:, None])[:, 0]] = torch.cat(parts, 1)
        # the entries of the windows that close in this forward
        first = (w0[:, None] + torch.arange(W, device=dev)) * m  # [B, W]
        closed = (first + m - 1) <= p1[:, None]
        if bool(closed.any()):
            end = (first + m - 1)[closed]
            rows = torch.arange(B, device=dev)[:, None].expand(B, W)[closed]
            done = self._finish(e_state[0][closed][None], first[closed][None], ctx, entry_pool.dtype)[0]
            entry_pool[table[rows, end // bs], (end % bs) // m] = done
        # every row's entries so far (windows closed by the batch's last position)
        n = int(p1.max() + 1) // m
        end = torch.arange(n, device=dev) * m + m - 1
        return entry_pool[table[:, end // bs], ((end % bs) // m).expand(B, n)]


class Indexer(WindowCompressor):
    """CSA's lightning indexer (frozen): its own overlapping compressor at index_head_dim, query heads
    from the q_a latent, a weight per head; keeps each query's index_topk best visible entries."""

    def __init__(self, cfg: ModelConfig) -> None:
        v = cfg.v4
        assert v is not None
        super().__init__(cfg.hidden_size, v.index_head_dim, v.csa_rate, True, cfg.rms_norm_eps)
        self.n_heads, self.top_k = v.index_n_heads, v.index_topk
        self.q_b_proj = nn.Linear(v.q_lora_rank, v.index_n_heads * v.index_head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, v.index_n_heads, bias=False)

    @torch.no_grad()
    def select(self, x: Tensor, q_resid: Tensor, ctx: Ctx, visible: Tensor, li: int) -> Tensor:
        """visible [B, T, W] (causal over the compressed entries) narrowed to each query's top-k."""
        B, T, _ = x.shape
        kv, gate = self.inputs(x, None, None, 0)
        if ctx.cache is None:
            keys = self.entries(kv, gate, ctx)
        else:
            pools = ctx.cache.cache.pools
            keys = self.cached_entries(kv, gate, ctx, pools["csa_ientry"][li], pools["csa_istate"][li])
        cos, sin = ctx.compress
        q = rotate(self.q_b_proj(q_resid).view(B, T, self.n_heads, self.dim), cos[:, :, None], sin[:, :, None])
        scores = F.relu(torch.einsum("bthd,bwd->bthw", q.float(), keys.float())) * self.dim**-0.5
        w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5
        index = torch.einsum("bth,bthw->btw", w, scores).masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.top_k, index.shape[-1]), dim=-1).indices
        return visible & torch.zeros_like(visible).scatter_(-1, top, True)


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        v = cfg.v4
        assert v is not None
        h, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.spec, self.layer, self.n_heads, self.head_dim, self.eps = v, layer, H, D, cfg.rms_norm_eps
        self.kind = v.layer_types[layer]
        self.q_a_proj = nn.Linear(h, v.q_lora_rank, bias=False)
        self.q_a_norm = V4Norm(v.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(v.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(h, D, bias=False)
        self.kv_norm = V4Norm(D, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(H * D // v.o_groups, v.o_groups * v.o_lora_rank, bias=False)  # per group
        self.o_b_proj = nn.Linear(v.o_groups * v.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        if self.kind != SLIDING:
            self.kind_index = v.layers_of(self.kind).index(layer)  # in its kind's targets and pools
            self.compressor = WindowCompressor(h, D, v.rate(layer), self.kind == CSA, cfg.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = Indexer(cfg)

    def forward(self, x: Tensor, ctx: Ctx, lora: LoraBatch | None) -> Tensor:
        B, T, _ = x.shape
        L, H, D, v = self.layer, self.n_heads, self.head_dim, self.spec
        cos, sin = ctx.main if self.kind == SLIDING else ctx.compress
        q_resid = self.q_a_norm(project(self.q_a_proj, x, lora, "q_a_proj", L))
        q = unit_norm(project(self.q_b_proj, q_resid, lora, "q_b_proj", L).view(B, T, H, D), self.eps)
        q = rotate(q, cos[:, :, None], sin[:, :, None])
        kv = rotate(self.kv_norm(project(self.kv_proj, x, lora, "kv_proj", L)), cos, sin)  # [B, T, D]
        keys, visible = self._window(kv, ctx)
        if self.kind != SLIDING:
            entries, sees = self._compressed(x, q_resid, ctx, lora)
            keys, visible = torch.cat((keys, entries), 1), torch.cat((visible, sees), -1)
        y = attend(q, keys, visible, self.sinks, D**-0.5)  # [B, T, H, D]
        y = rotate(y, cos[:, :, None], -sin[:, :, None])  # K = V: undo the keys' rotation on the output
        g = v.o_groups
        w = self.o_a_proj.weight.view(g, -1, H * D // g)  # [g, o_lora_rank, in per group]
        y = torch.einsum("btgi,goi->btgo", y.reshape(B, T, g, -1), w).reshape(B, T, -1)
        return project(self.o_b_proj, y, lora, "o_b_proj", L)

    def _window(self, kv: Tensor, ctx: Ctx) -> tuple[Tensor, Tensor]:
        """The sliding window's keys [B, S, D] and which each query sees [B, T, S]."""
        win, pos = self.spec.sliding_window, ctx.positions
        view = ctx.cache
        if view is None:
            keys, key_pos = kv, pos
        else:
            pool = view.cache.pools["kv"][self.layer]  # [blocks, block_size, D]
            pool[view.write_block, view.write_offset] = kv
            bs = pool.shape[1]
            lo = max(0, int(pos.min()) - win + 1) // bs  # blocks before it are out of every query's window
            keys = pool[view.table[:, lo:]].flatten(1, 2)
            key_pos = (lo * bs + torch.arange(keys.shape[1], device=kv.device)).expand(kv.shape[0], -1)
        k, q = key_pos[:, None, :], pos[:, :, None]
        return keys, (k <= q) & (k > q - win)

    def _compressed(self, x: Tensor, q_resid: Tensor, ctx: Ctx, lora: LoraBatch | None) -> tuple[Tensor, Tensor]:
        """This layer's compressed entries [B, W, D] and which each query sees [B, T, W]."""
        c = self.compressor
        prefix = "csa_" if self.kind == CSA else "hca_"
        kv, gate = c.inputs(x, lora, prefix, self.kind_index)
        if ctx.cache is None:
            entries = c.entries(kv, gate, ctx)
        else:
            pools = ctx.cache.cache.pools
            entries = c.cached_entries(kv, gate, ctx, pools[prefix + "entry"][self.kind_index],
                                       pools[prefix + "state"][self.kind_index])
        w = torch.arange(entries.shape[1], device=x.device)
        sees = w[None, None, :] < ((ctx.positions + 1) // c.rate)[:, :, None]
        if self.kind == CSA:
            sees = c.indexer.select(x, q_resid, ctx, sees, self.kind_index)
        return entries, sees


def attend(q: Tensor, keys: Tensor, visible: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """Every head of q [B, T, H, D] over the shared keys (= values) [B, S, D] where visible [B, T, S],
    with a per-head sink logit in the softmax that takes weight but gives no value."""
    B, T, H, _ = q.shape
    scores = torch.einsum("bthd,bsd->bhts", q, keys).float() * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    logits = torch.cat((scores, sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)), -1)
    p = logits.softmax(-1)[..., :-1].to(keys.dtype)
    return torch.einsum("bhts,bsd->bthd", p, keys)


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: from the n streams, the pre (collapse), post (expand)
    and Sinkhorn-normalised comb (stream mixing) weights, all float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.v4
        assert v is not None
        n = v.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, v.hc_sinkhorn_iters, v.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, n, _ = streams.shape
        mix = F.linear(unit_norm(streams.reshape(B, T, -1).float(), self.eps), self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], -1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.view(B, T, n, n) * s[2] + comb_b.view(n, n), -1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        return post, comb, (pre[..., None] * streams).sum(2).to(streams.dtype)


def hc_mix(streams: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The block's output spread over the streams by post, plus the streams mixed by comb (its
    transpose: stream k gets Σ_j comb[j, k] · stream j)."""
    dt = streams.dtype
    return post.to(dt)[..., None] * out[..., None, :] + comb.to(dt).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The final collapse of the streams (before the last norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.v4
        assert v is not None
        self.hc_eps, self.eps = v.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(v.hc_mult, v.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(v.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: Tensor) -> Tensor:
        B, T = streams.shape[:2]
        mix = F.linear(unit_norm(streams.reshape(B, T, -1).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre[..., None] * streams).sum(2).to(streams.dtype)


def clamped_swiglu(g: Tensor, u: Tensor, limit: float) -> Tensor:
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        v = cfg.v4
        assert v is not None
        inter = cfg.moe_intermediate_size  # one shared expert, whatever n_shared_experts says (as transformers)
        self.index, self.limit = index, v.swiglu_limit
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: LoraBatch | None) -> Tensor:
        g = project(self.gate_proj, x, lora, "shared_gate_proj", self.index)
        u = project(self.up_proj, x, lora, "shared_up_proj", self.index)
        return project(self.down_proj, clamped_swiglu(g, u, self.limit), lora, "shared_down_proj", self.index)


class Router(nn.Module):
    """HF's `mlp.gate`: weight [E, hidden] (float32), and the choice-only bias or, in a hash layer,
    the token → experts table."""

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))


SCORES = {"sqrtsoftplus": lambda z: F.softplus(z).sqrt(), "sigmoid": torch.sigmoid}


class V4MoE(SparseMoE):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)  # every layer is sparse: its index among them is the layer
        v = cfg.v4
        assert v is not None
        self.hashed, self.limit, self.scaling = layer in v.hash_layers, v.swiglu_limit, v.routed_scaling_factor
        self.score = SCORES[v.scoring_func]
        self.gate = Router(cfg, self.hashed)  # type: ignore[assignment]
        self.shared_experts = SharedExpert(cfg, layer)

    def route(self, x: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        scores = self.score(F.linear(x.float(), self.gate.weight.float()))
        if self.hashed:
            assert tokens is not None, "a hash-routed layer needs the token ids"
            chosen = self.gate.tid2eid[tokens].long()
        else:
            chosen = (scores + self.gate.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), chosen

    def act(self, g: Tensor, u: Tensor) -> Tensor:
        return clamped_swiglu(g, u, self.limit)

    def forward(self, x: Tensor, lora: LoraBatch | None, tokens: Tensor | None = None) -> Tensor:
        return super().forward(x, lora, tokens) + self.shared_experts(x, lora)


class V4Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = V4Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = V4Attention(cfg, layer)
        self.post_attention_layernorm = V4Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = V4MoE(cfg, layer)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams: Tensor, ctx: Ctx, lora: LoraBatch | None) -> Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = hc_mix(streams, self.self_attn(self.input_layernorm(x), ctx, lora), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return hc_mix(streams, self.mlp(self.post_attention_layernorm(x), lora, ctx.tokens), post, comb)


class DeepseekV4Transformer(Transformer):
    ragged = False  # the compressor reads each row's positions: the executor runs steps per segment kind

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.v4 is None:
            raise ValueError("DeepseekV4Transformer needs a DeepSeek-V4 config")
        super().__init__(cfg, block=V4Block)
        self.norm = V4Norm(cfg.hidden_size, cfg.rms_norm_eps)  # type: ignore[assignment]
        self.hc_head = HyperHead(cfg)

    def hidden_states(self, tokens: Tensor, positions: Tensor | None = None, lora: LoraBatch | None = None,
                      cache: CacheView | None = None, recomputed_blocks: int = 0, vision: object = None) -> Tensor:
        """tokens [B, T] → final-norm hidden states [B, T, hidden]. Without a cache every row starts
        at position 0 (the compressors pool windows from there). A text-only family: `vision` is None."""
        assert vision is None
        v = self.config.v4
        assert v is not None
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        x = self.embed_tokens(tokens)
        main, compress = inv_freq_of(v, False), inv_freq_of(v, True)
        factor = rope_attention_factor(v.compress_rope)
        ctx = Ctx(tokens, positions, rope_of(main, positions, 1.0, x.dtype),
                  rope_of(compress, positions, factor, x.dtype), compress, factor, cache)
        streams = x[:, :, None].expand(B, T, v.hc_mult, x.shape[-1]).contiguous()
        recompute = recomputed_blocks if cache is None and torch.is_grad_enabled() else 0
        for i, block in enumerate(self.layers):
            if i < recompute:
                streams = torch.utils.checkpoint.checkpoint(block, streams, ctx, lora, use_reentrant=False)
            else:
                streams = block(streams, ctx, lora)
        return self.norm(self.hc_head(streams))
