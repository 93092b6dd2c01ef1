"""The per-token math of sampling: picking tokens, their logprobs, prompt logprobs, stop conditions.

Reported logprobs are always log_softmax of the raw model logits (temperature 1, no top-k/top-p) at
the chosen token: exactly what the training forward computes for the same adapter and sequence, so
importance ratios and StableReinforce compare like with like. Everything else only shapes which
token is drawn, in this order: a grammar's bitmask (tokens outside it are -inf), logit_bias (added),
the repetition penalty, the presence and frequency penalties, then temperature, top-k, top-p and
min-p. The top-n alternatives reported next to a token come from the same raw distribution as its
own logprob.

Draws are inverse-CDF with one uniform number per row taken from that row's own generator, and
every tensor op here is row-wise, so a row's token depends on its own logits and generator only —
never on which other rows share the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from tinker.types.tensor_data import TensorData
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs
from torch import Tensor

Decode = Callable[[list[int]], str]


class Chosen(NamedTuple):
    tokens: Tensor  # [B] long
    logprobs: Tensor  # [B] float32: the raw model's logprob of each chosen token
    top_ids: Tensor | None  # [B, top_n] long: the most likely tokens under that same distribution, best first
    top_logprobs: Tensor | None  # [B, top_n] float32: their logprobs (a chosen token among them has its own value)


def choose_tokens(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor,
    penalty: Tensor | None = None, top_n: int = 0, repetition: tuple[Tensor, Tensor] | None = None,
    min_p: Tensor | None = None, allowed: tuple[Tensor, Tensor] | None = None,
    bias: tuple[Tensor, Tensor, Tensor] | None = None, processed: Tensor | None = None,
) -> Chosen:
    """Pick one token per row; return them with their raw logprobs (and the top_n alternatives).

    logits [B, V]; temperature [B] (0 = greedy); top_k [B] long (≤ 0 = no limit); top_p [B] in (0, 1];
    uniform [B] float64 in [0, 1), ignored for greedy rows; allowed (rows [G] long, bitmask [G, ⌈V/32⌉]
    int32) or None: those rows' tokens whose bit is 0 get -inf (grammar.Grammars.masks; other rows are
    untouched); bias (rows, token ids, values), each [N], or None: added to those logits (see
    `logit_biases`); repetition (seen [B, V] bool, factor [B]) or None: seen tokens' logits divided
    by the factor when positive, multiplied when negative; penalty [B, V] or None: then subtracted
    (see `penalties`); min_p [B] or None (see `draw`). All of them shape the logits the draw sees,
    never the reported logprobs — except in the rows where `processed` [B] bool is set (vLLM's
    logprobs_mode="processed_logprobs"): those rows report the logprobs of the distribution the
    draw used (`processed_logprobs`), their top_n alternatives too.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    shaped = logits
    if allowed is not None:
        rows, bits = allowed
        shaped = shaped.clone()
        shaped[rows] = shaped[rows].masked_fill(~unpack_bitmask(bits, shaped.shape[-1]), float("-inf"))
    if bias is not None:
        rows, ids, values = bias
        shaped = shaped.index_put((rows, ids), values.float(), accumulate=True)
    if repetition is not None:
        seen, factor = repetition
        f = factor[:, None].float()
        shaped = torch.where(seen, torch.where(shaped > 0, shaped / f, shaped * f), shaped)
    if penalty is not None:
        shaped = shaped - penalty
    rows = shaped.shape[0]
    drawn = (temperature > 0).nonzero().flatten()
    if drawn.numel() < rows:  # greedy rows
        tokens = shaped.argmax(dim=-1)
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=shaped.device)
    if drawn.numel():
        every = drawn.numel() == rows  # then no row-gathering copies of [rows, V]
        scaled = shaped if every else shaped[drawn]
        t = temperature if every else temperature[drawn]
        if bool((t != 1).any()):
            scaled = scaled / t[:, None].float()
        pick = (lambda v: v) if every else (lambda v: v[drawn])
        tokens[drawn] = draw(scaled, pick(top_k), pick(top_p), pick(uniform), None if min_p is None else pick(min_p))
    if processed is not None and bool(processed.any()):
        rows_p = processed.nonzero().flatten()
        logp = logp.clone()
        logp[rows_p] = processed_logprobs(shaped[rows_p], temperature[rows_p], top_k[rows_p], top_p[rows_p],
                                          None if min_p is None else min_p[rows_p])
    top_ids = top_logprobs = None
    if top_n > 0:
        top_logprobs, top_ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
    return Chosen(tokens, logp.gather(1, tokens[:, None]).squeeze(1), top_ids, top_logprobs)


def processed_logprobs(shaped: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                       min_p: Tensor | None = None) -> Tensor:
    """The log of the distribution `draw` samples from, [B, V]: log_softmax of the shaped logits
    (grammar mask, logit_bias and penalties already applied) divided by the temperature (greedy
    rows, temperature 0, by 1, as vLLM does), restricted to the top-k, the top-p nucleus and the
    min-p floor and renormalised; tokens outside them are -inf."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    scaled = shaped.float() / t[:, None]
    if min_p is None:
        min_p = torch.zeros(scaled.shape[0], device=scaled.device)
    vocab = scaled.shape[-1]
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(ranked, dim=-1)
    k = torch.where(top_k > 0, top_k, vocab)
    rank = torch.arange(vocab, device=scaled.device)
    keep = rank[None, :] < k[:, None]
    probs = probs.masked_fill(~keep, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None].float()  # the nucleus, as `draw` cuts it
    keep &= probs >= min_p[:, None].float() * probs[:, :1]
    kept = ranked.masked_fill(~keep, float("-inf"))
    out = torch.log_softmax(kept, dim=-1)
    return torch.empty_like(out).scatter_(1, order, out)


def unpack_bitmask(bits: Tensor, vocab: int) -> Tensor:
    """[G, W] int32 → [G, vocab] bool: token t is allowed where bit t % 32 of word t // 32 is 1."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]


def logit_biases(biases: Sequence[Sequence[tuple[int, float]]], device: torch.device) -> tuple[Tensor, Tensor, Tensor] | None:
    """Each row's (token id, bias) pairs as (rows, token ids, values) for `choose_tokens`; None if none."""
    flat = [(i, t, b) for i, pairs in enumerate(biases) for t, b in pairs]
    if not flat:
        return None
    rows, ids, values = zip(*flat, strict=True)
    return (torch.tensor(rows, device=device), torch.tensor(ids, device=device),
            torch.tensor(values, dtype=torch.float32, device=device))


def penalties(histories: Sequence[Sequence[int]], frequency: Sequence[float], presence: Sequence[float],
              vocab: int, device: torch.device) -> Tensor:
    """OpenAI's presence and frequency penalties [B, V] from each row's generated tokens so far:
    frequency × count[t] + presence × (count[t] > 0)."""
    out = torch.zeros(len(histories), vocab)
    for i, (tokens, freq, pres) in enumerate(zip(histories, frequency, presence, strict=True)):
        if tokens and (freq or pres):
            counts = torch.bincount(torch.tensor(tokens), minlength=vocab).float()
            out[i] = freq * counts + pres * (counts > 0).float()
    return out.to(device)


def seen_tokens(histories: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """[B, V] bool: which tokens each row has seen (its prompt and what it generated so far)."""
    out = torch.zeros(len(histories), vocab, dtype=torch.bool)
    for i, tokens in enumerate(histories):
        if tokens:
            out[i, torch.tensor(tokens, dtype=torch.long)] = True
    return out.to(device)


def draw(scaled: Tensor, top_k: Tensor, top_p: Tensor, uniform: Tensor, min_p: Tensor | None = None) -> Tensor:
    """Inverse-CDF draw from softmax(scaled) restricted to the top-k, then to the top-p nucleus, then
    to the tokens with at least min_p × the most likely token's probability."""
    out = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    if min_p is None:
        min_p = torch.zeros(scaled.shape[0], device=scaled.device)
    filtered = (top_k > 0) | (top_p < 1) | (min_p > 0)
    plain = (~filtered).nonzero().flatten()
    if plain.numel():  # no filter: no sort needed, the CDF in vocabulary order serves as well
        x = scaled if plain.numel() == scaled.shape[0] else scaled[plain]
        out[plain] = inverse_cdf((x - x.amax(dim=-1, keepdim=True)).exp_(), uniform[plain])  # unnormalised
    rows = filtered.nonzero().flatten()
    if rows.numel():
        vocab = scaled.shape[-1]
        ranked, order = scaled[rows].sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(ranked, dim=-1)
        k = torch.where(top_k[rows] > 0, top_k[rows], vocab)
        rank = torch.arange(vocab, device=scaled.device)
        probs = probs.masked_fill(rank[None, :] >= k[:, None], 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        # The nucleus: the fewest top tokens whose mass reaches top_p (the token crossing it stays in).
        mass_above = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_above >= top_p[rows, None].float(), 0.0)
        probs = probs.masked_fill(probs < min_p[rows, None].float() * probs[:, :1], 0.0)  # [:, 0]: the likeliest
        out[rows] = order.gather(1, inverse_cdf(probs, uniform[rows])[:, None]).squeeze(1)
    return out


def inverse_cdf(probs: Tensor, uniform: Tensor, block: int = 256) -> Tensor:
    """Index i with cdf[i-1] ≤ u·total < cdf[i] per row (probs [B, V] ≥ 0, not necessarily
    normalised); zero-probability entries are never chosen.

    Two levels: the cumulative sums (float64) of `block`-wide blocks' sums find the block, then one
    block's cumulative sum finds the entry — the same index as one float64 cumulative sum over the
    whole vocabulary up to rounding at a boundary, for a tenth of its cost on a 49k vocabulary.
    """
    rows, vocab = probs.shape
    pad = (-vocab) % block
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = padded.view(rows, -1, block)
    block_cdf = blocks.sum(-1).to(torch.float64).cumsum(-1)  # [B, blocks]; a block's own sum in fp32
    target = (uniform.to(torch.float64) * block_cdf[:, -1])[:, None]
    b = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_cdf.shape[1] - 1)  # [B, 1]
    base = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    within = blocks.gather(1, b[:, :, None].expand(rows, 1, block))[:, 0].to(torch.float64).cumsum(-1) + base
    j = torch.searchsorted(within, target, right=True)[:, 0]
    idx = b[:, 0] * block + j
    # Rounding can put u·total at the very end (or just past a block): take the last token with mass.
    over = (j >= block) | (idx >= vocab)
    if bool(over.any()):
        last = vocab - 1 - (probs[over] > 0).flip(-1).int().argmax(dim=-1)
        idx[over] = last
    return idx


def sample_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for sample `index` of a request seeded `seed`.

    Hashed, not seed + index, so request (seed=5, sample 1) and request (seed=6, sample 0) do not
    share a stream.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def uniforms(generators: Sequence[torch.Generator | None]) -> Tensor:
    """One U[0, 1) draw per row from its own (CPU) generator; 0 for greedy rows, which draw nothing."""
    return torch.tensor(
        [0.0 if g is None else torch.rand((), generator=g, dtype=torch.float64).item() for g in generators],
        dtype=torch.float64,
    )


@dataclass(frozen=True)
class StopCondition:
    """When a sequence ends early: a stop token was sampled, or the text now contains a stop string.

    Stop strings are matched on decoded text, so one split across tokens (or inside a token) is
    found at the token that completes it. The sampled tokens then end with that token.
    """

    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()
    decode: Decode | None = None

    @property
    def window(self) -> int:
        # Tokens to decode so any newly completed stop string lies inside the text: a character
        # rarely spans more than 4 byte-level tokens; one extra token guards the window's start.
        return 4 * max(len(s) for s in self.strings) + 1

    def hit(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.token_ids:
            return True
        if self.strings and self.decode is not None:
            # A string that was complete before this token would already have stopped the sequence,
            # so finding one in the window means this token completed it.
            text = self.decode(tokens[-self.window :])
            return any(s in text for s in self.strings)
        return False


@dataclass
class PromptScores:
    """Logprobs of a prompt's tokens: logprobs[i] scores prompt[i] given prompt[:i] (NaN at i = 0)."""

    logprobs: np.ndarray  # [P] float32
    topk_ids: np.ndarray  # [P, k] int32; row 0 is the SDK's "nothing here" sentinel
    topk_logprobs: np.ndarray  # [P, k] float32

    @classmethod
    def empty(cls, n: int, k: int) -> PromptScores:
        return cls(np.full(n, np.nan, dtype=np.float32), np.zeros((n, k), dtype=np.int32),
                   np.full((n, k), MASK_LOGPROB, dtype=np.float32))

    def fill(self, start: int, piece: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Scores of the prompt positions start.. (score_targets of them, each scoring the next token)."""
        lps, ids, tops = piece[:3]
        n = min(len(lps), len(self.logprobs) - start - 1)
        k = self.topk_ids.shape[1]
        self.logprobs[start + 1 : start + 1 + n] = lps[:n]
        self.topk_ids[start + 1 : start + 1 + n] = ids[:n, :k]
        self.topk_logprobs[start + 1 : start + 1 + n] = tops[:n, :k]

    def topk(self, k: int) -> TopkLogprobs:
        return TopkLogprobs(token_ids=self.topk_ids[:, :k].copy(), logprobs=self.topk_logprobs[:, :k].copy())

    def last(self, n: int | None) -> PromptScores:
        """Only the last n prompt tokens' scores (prompt_logprobs_last_n); earlier ones as if not computed."""
        if n is None or n >= len(self.logprobs) - 1:
            return self
        out = PromptScores(self.logprobs.copy(), self.topk_ids.copy(), self.topk_logprobs.copy())
        cut = len(self.logprobs) - n
        out.logprobs[:cut] = np.nan
        out.topk_ids[:cut] = 0
        out.topk_logprobs[:cut] = MASK_LOGPROB
        return out


@dataclass(frozen=True, eq=False)
class PromptTargets:
    """SampleRequest.target_prompt_logprobs, parsed (preparer.Preparer): `ids` are the listed cells' token
    ids in row-major order — every cell of a dense [P - 1, K] tensor, or the CSR tensor's listed
    ones — and `crow`/`col` the CSR layout (None: dense). Row i scores prompt position i + 1, that is
    the logits at position i. A cell of -1 requests nothing."""

    shape: tuple[int, int]
    ids: np.ndarray  # int64 [cells]
    crow: np.ndarray | None = None  # int64 [P]: the request's row pointers
    col: np.ndarray | None = None  # int64 [cells]

    @property
    def rows(self) -> np.ndarray:
        """Each listed cell's row."""
        if self.crow is None:
            return np.repeat(np.arange(self.shape[0], dtype=np.int64), self.shape[1])
        return np.repeat(np.arange(self.shape[0], dtype=np.int64), np.diff(self.crow))

    def wanted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cell index, row, token id) of the cells that request something, by row."""
        rows = self.rows
        keep = np.flatnonzero(self.ids >= 0)
        return keep, rows[keep], self.ids[keep]

    def response(self, values: np.ndarray) -> TensorData:
        """The logprobs of every listed cell (0.0 where it held -1) in the request's own layout."""
        data = np.asarray(values, dtype=np.float32)
        if self.crow is None:
            return TensorData(data=data.reshape(self.shape), dtype="float32", shape=list(self.shape))
        assert self.col is not None
        return TensorData(data=data, dtype="float32", shape=list(self.shape),
                          sparse_crow_indices=self.crow.tolist(), sparse_col_indices=self.col.tolist())


@dataclass(frozen=True, eq=False)
class PromptAsk:
    """One request's prompt work beyond prompt logprobs in one prefill chunk (see ScoreSpec):
    target cells at chunk-relative positions `cell_rows` with token ids `cell_ids`, and `alt_k`
    draws at each of the chunk's first `alt_rows` positions at `temperature` (0: the argmax),
    position p's from a generator seeded alt_seed(seed, first + p)."""

    cell_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cell_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    alt_k: int = 0
    alt_rows: int = 0
    temperature: float = 1.0
    seed: int = 0
    first: int = 0


@dataclass(frozen=True, eq=False)
class ScoreSpec:
    """A prefill chunk's scoring when some request wants more than prompt logprobs: it rides in
    StepBatch.scoring where a plain target list does (`score_targets` takes either)."""

    targets: list[int]
    asks: tuple[PromptAsk, ...] = ()


class ScorePiece(NamedTuple):
    """score_targets' answer for a ScoreSpec: the plain answer's three arrays, then per ask its target
    cells' logprobs [m] and its draws ([alt_rows, k] token ids, [alt_rows, k] raw logprobs; None when
    it asked for none)."""

    logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    cells: tuple[np.ndarray, ...]
    alts: tuple[tuple[np.ndarray, np.ndarray] | None, ...]


def alt_seed(seed: int, position: int) -> int:
    """The generator seed of a request's prompt_alt_tokens draws at one prompt position: hashed from
    (seed, position), so the draws do not depend on how the prompt was cut into chunks."""
    digest = hashlib.blake2b(f"{seed}:alt:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_alternatives(logits: Tensor, k: int, temperature: float, seeds: Sequence[int]) -> Tensor:
    """k independent draws (with replacement) per row of logits [m, V] from softmax(logits / T),
    row i's uniforms from a generator seeded seeds[i]; temperature 0: the argmax k times."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True).expand(-1, k).clone()
    u = torch.stack([torch.rand(k, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds])
    probs = torch.softmax(logits.float() / temperature, dim=-1).to(torch.float64)
    cdf = probs.cumsum(dim=-1)
    u = u.to(cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=logits.shape[-1] - 1)


def score_targets(
    logits_of: Callable[[Tensor], Tensor], hidden: Tensor, targets: Sequence[int] | ScoreSpec, k: int, chunk: int = 512
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | ScorePiece:
    """Logprob of targets[i] (and the top-k) from hidden states [n, hidden] of n consecutive positions;
    NaN (and no top-k) where targets[i] < 0. `logits_of` maps [1, m, hidden] to [1, m, V]; chunked so
    a long prompt never holds an [n, V] float32 logits matrix at once. Only the positions something
    needs are run through the head (prompt_logprobs_last_n scores a suffix: the rows before it cost
    nothing). With a ScoreSpec, its asks (target cells, alternative draws) are answered from the
    same logits, and the answer is a ScorePiece."""
    spec = targets if isinstance(targets, ScoreSpec) else None
    if spec is not None:
        targets = spec.targets
    asks = spec.asks if spec is not None else ()
    n = len(targets)
    lps = np.full(n, np.nan, dtype=np.float32)
    ids = np.zeros((n, k), dtype=np.int32)
    tops = np.full((n, k), MASK_LOGPROB, dtype=np.float32)
    cells = [np.zeros(len(a.cell_ids), dtype=np.float32) for a in asks]
    alts = [(np.zeros((a.alt_rows, a.alt_k), dtype=np.int64), np.zeros((a.alt_rows, a.alt_k), dtype=np.float32))
            if a.alt_k and a.alt_rows else None for a in asks]
    scored = [i for i, t in enumerate(targets) if t >= 0]
    need = [scored[0], scored[-1] + 1] if scored else []
    for a in asks:
        if len(a.cell_rows):
            need += [int(a.cell_rows.min()), int(a.cell_rows.max()) + 1]
        if a.alt_k and a.alt_rows:
            need += [0, a.alt_rows]
    if need:
        lo, hi = min(need), max(need)
        want = torch.tensor([max(t, 0) for t in targets], device=hidden.device)
        for start in range(lo, hi, chunk):
            stop = min(start + chunk, hi)
            raw = logits_of(hidden[None, start:stop])[0].float()
            logp = torch.log_softmax(raw, dim=-1)
            if scored:
                a_, b_ = max(start, scored[0]), min(stop, scored[-1] + 1)
                if a_ < b_:
                    sl = slice(a_ - start, b_ - start)
                    lps[a_:b_] = logp[sl].gather(1, want[a_:b_, None]).squeeze(1).cpu().numpy()
                    if k:
                        v, i = logp[sl].topk(min(k, logp.shape[-1]), dim=-1)
                        tops[a_:b_, : v.shape[1]] = v.cpu().numpy()
                        ids[a_:b_, : i.shape[1]] = i.cpu().numpy()
            for j, a in enumerate(asks):
                inside = np.flatnonzero((a.cell_rows >= start) & (a.cell_rows < stop))
                if inside.size:
                    r = torch.as_tensor(a.cell_rows[inside] - start, device=logp.device)
                    t = torch.as_tensor(a.cell_ids[inside], device=logp.device)
                    cells[j][inside] = logp[r, t].cpu().numpy()
                out = alts[j]
                if out is not None and start < a.alt_rows:
                    b_ = min(stop, a.alt_rows)
                    for s0 in range(start, b_, 64):  # the draw's float64 CDF, 64 rows at a time
                        s1 = min(s0 + 64, b_)
                        drawn = draw_alternatives(raw[s0 - start : s1 - start], a.alt_k, a.temperature,
                                                  [alt_seed(a.seed, a.first + p) for p in range(s0, s1)])
                        out[0][s0:s1] = drawn.cpu().numpy()
                        out[1][s0:s1] = logp[s0 - start : s1 - start].gather(1, drawn).cpu().numpy()
    if spec is None:
        return lps, ids, tops
    return ScorePiece(lps, ids, tops, tuple(cells), tuple(alts))
