"""The training pass: fused forward/backward over many adapters, and its planning.

The engine's single worker thread drives a `Trainer` synchronously. `run()` takes the pending
forward / forward_backward requests of any number of adapters and does one batched pass for the
backward ones (each row carries its adapter index, so gradients land only in their own adapter)
and one no-grad pass for the forward-only ones. Datums are packed end to end into one row with
per-datum attention (`Transformer.packed_hidden_states`): no token of padding is computed. Where
packing does not apply (`packing_unsupported`: some families, tensor parallelism, batch-invariant
mode) datums are right-padded to the longest row: the attention is causal, so padding after a
row's last token cannot change its logits, and the loss masks it. Either way the losses see each
request's rows padded ([rows, T, K], `losses.py`); packed logprobs are laid out so for them. A
token budget splits very large fused batches into micro-batches whose gradients are summed, which
is exact because every Tinker loss is a sum over positions.

Gradients accumulate in `Adapter.grads` (float32) until `optim_step` (`adapter_state.py`, with the
rest of an adapter's state: master weights, save/load, export, interpolation). Reverse KL has its
own room (`reverse_kl.py`); the pass's trainable LoRA (leaves, their batch by row or by token, their
gradients) is `training_lora.py`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tinker import types
from torch import Tensor

from mint_server.engine.custom_loss import run_per_datum
from mint_server.engine.jobs import CustomJob, TrainJob
from mint_server.engine.losses import ParsedDatum, TargetLogprobs, pad_inputs
from mint_server.engine.residency import Adapter, Residency
from mint_server.engine.runner import Shard, op
from mint_server.engine.training_lora import (
    LoraRef,
    TokenLora,
    accumulate,
    leaf_grads,
    training_lora,
)
from mint_server.engine.values import EngineError
from mint_server.model import invariant
from mint_server.model.compiled_training import attach as attach_compiled_blocks
from mint_server.model.families import family_spec
from mint_server.model.lora import LoraBatch
from mint_server.model.qwen3_vl import FeatureCache
from mint_server.model.transformer import Attention, Block, Transformer
from mint_server.model.vision_input import VisionInput

Output = types.ForwardBackwardOutput
OUTPUT_TYPE = "ArrayRecord"
log = logging.getLogger(__name__)


@dataclass
class _Prepared:
    job: TrainJob
    adapter: Adapter | None

    @property
    def datums(self) -> tuple:
        return self.job.datums


@dataclass
class Row:
    req: int  # index into the pass's requests
    datum: int
    length: int


class Trainer:
    """Training ops over device-resident adapters; not thread-safe (one worker drives it).

    Jobs arrive parsed and checked (`preparer.Preparer`); the trainer only checks what may have changed
    since (the adapter exists and is trainable).

    max_len: longest datum accepted (default: the model's max_position_embeddings).
    Token counts below are the tokens a micro-batch computes: its datums' own lengths when packed,
    rows × longest row when padded.

    max_tokens_per_pass: tokens per forward/backward; a bigger fused batch is split into
        micro-batches (packed: in request order; padded: longest rows first). None = never split.
    checkpoint_from_tokens: the block activations a micro-batch may keep for backward, in tokens
        through every block. A micro-batch of T > B of them recomputes
        its first k = ceil((1 − B/T)·L) of the L blocks in backward (activation checkpointing: they
        keep only their input), so it keeps the activations of ~B tokens at the cost of k/L of one
        more forward. None = never.
    logits_chunk: most logits elements materialised at once; above it the lm_head + log-softmax
        run in even position chunks, all but the last recomputed in backward, so the
        [rows, T, vocab] logits (the biggest tensors of a small-hidden, big-vocab model) never
        exist whole.

    Fusing never raises the peak: a micro-batch that holds more padded tokens than the largest of
    its requests would alone recomputes enough blocks to keep no more block activations than that
    request keeps alone, and chunks its logits at that request's size (`memory_plan`), so fused
    policies train within the memory of the biggest one; a request alone runs at full speed up to
    the two bounds above. Batch-invariant mode leaves fused passes at the bounds of their own size,
    so a request's gradients do not depend on what it was fused with.
    """

    def __init__(
        self,
        model: Transformer,
        residency: Residency,
        base_model: str,
        *,
        max_tokens_per_pass: int | None = 16384,
        checkpoint_from_tokens: int | None = 4096,
        logits_chunk: int = 2**28,
        pack: bool = True,
        compile: str = "off",
        compile_now: bool = True,
    ) -> None:
        """compile "auto": the blocks of its passes compiled (model/compiled_training.py), counted in
        stats, in a background warm-up started here or (compile_now False) by `compile`."""
        self.model, self.residency, self.base_model = model, residency, base_model
        self.pack = pack  # False: always the padded path (benchmarks compare the two)
        self._unpacked_reason = packing_unsupported(model)
        # tokens computed by training passes: real ones, and padding (padded path only)
        self.stats = {"packed_passes": 0, "padded_passes": 0, "tokens": 0, "padding_tokens": 0}
        self._logged: set[str] = set()
        self.max_tokens_per_pass = max_tokens_per_pass
        self.checkpoint_from_tokens = checkpoint_from_tokens
        self.logits_chunk = logits_chunk
        self.device, self.vocab = residency.device, model.config.vocab_size
        self.features = FeatureCache()  # encoded images by digest (vision-language bases)
        model.requires_grad_(False)  # only adapters train; the base never gets a gradient
        self.compiled = attach_compiled_blocks(model, compile, self.stats, start=compile_now)
        residency.runner.shard.model = model  # the runner's rank runs it (a residency alone has no model)

    def compile(self) -> None:
        """Compile the blocks now, on this thread (a no-op when compiled, warming or compile is off)."""
        self.compiled.start_warm_up(background=False)

    # --- forward / forward_backward -------------------------------------------------------------
    def run(self, jobs: Sequence[TrainJob], between: Callable[[], None] | None = None,
            slice_tokens: int | None = None) -> list[Output | Exception]:
        """Run requests of any adapters fused: one pass for the backward ones, one for forward-only.

        Each request gets its own result or exception. A request that fails validation fails
        alone; adapter gradients are committed only after the whole pass succeeded.
        between: called after every micro-batch but the last (the engine runs sampler steps there,
        so a long pass does not stall decoding); micro-batches are then at most slice_tokens tokens
        (real ones when packed, rows × longest row when padded). The gradients accumulate over them, equal to one pass's up to float rounding (not
        bitwise, so batch-invariant mode keeps its own split).
        """
        budget = self.max_tokens_per_pass
        if between is not None and slice_tokens and not invariant.enabled():
            budget = min(budget or slice_tokens, slice_tokens)
        results: list[Output | Exception | None] = [None] * len(jobs)
        groups: dict[bool, list[tuple[int, _Prepared]]] = {True: [], False: []}
        for i, job in enumerate(jobs):
            try:
                groups[job.backward].append((i, _Prepared(job, self._adapter(job.adapter_id, job.backward))))
            except EngineError as e:
                results[i] = e
        for backward, items in groups.items():
            if not items:
                continue
            try:
                outs = self._pass([p for _, p in items], backward, budget, between)
            except Exception as e:  # e.g. out of memory: those requests fail, no adapter changed
                outs = [e] * len(items)
            for (i, _), out in zip(items, outs, strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    def _adapter(self, adapter_id: str | None, backward: bool) -> Adapter | None:
        if adapter_id is None:
            if backward:
                raise EngineError("adapter_id: forward_backward needs an adapter; the base model is never trained")
            return None
        adapter = self.residency.on_device(adapter_id)
        if backward and not adapter.trainable:
            raise EngineError(f"adapter_id: adapter {adapter_id!r} is sampler-only, not trainable")
        return adapter

    def _pass(self, preps: list[_Prepared], backward: bool, budget: int | None = None,
              between: Callable[[], None] | None = None) -> list[Output | Exception]:
        rows = [Row(r, d, len(dat.tokens)) for r, p in enumerate(preps) for d, dat in enumerate(p.datums)]
        logprobs: dict[tuple[int, int], np.ndarray] = {}
        losses: dict[tuple[int, int], np.ndarray] = {}
        loss_sum = [0.0] * len(preps)
        runner = self.residency.runner
        packed = self._packs()
        # Tokens of the largest request alone (in micro-batches of the same budget).
        alone = max(min(sum(len(d.tokens) for d in p.datums) if packed
                        else len(p.datums) * max(len(d.tokens) for d in p.datums), budget or 1 << 62) for p in preps)
        micro_batch = self._packed_micro_batch if packed else self._micro_batch
        try:
            batches = self.plan_packed(rows, budget) if packed else self.plan(rows, budget)
            for i, mb in enumerate(batches):
                micro_batch(mb, preps, backward, logprobs, losses, loss_sum, alone)
                if between is not None and i + 1 < len(batches):
                    between()
        except BaseException:
            runner.call("train_commit", keep=False)  # every rank drops the pass's gradients
            raise
        # every rank adds its share of the pass's gradients to the adapters (non-finite ones refused)
        failed = {aid: self._non_finite(aid) for aid in runner.call("train_commit", keep=True)}
        outs: list[Output | Exception] = []
        for r, p in enumerate(preps):
            if p.adapter is not None and p.adapter.id in failed:
                outs.append(failed[p.adapter.id])
                continue
            per_datum = [
                {"logprobs": types.TensorData.from_numpy(logprobs[r, d]),
                 "elementwise_loss": types.TensorData.from_numpy(losses[r, d])}
                for d in range(len(p.datums))
            ]
            outs.append(Output(loss_fn_output_type=OUTPUT_TYPE, loss_fn_outputs=per_datum,
                               metrics={"loss:sum": loss_sum[r]}))
        return outs

    def _packs(self) -> bool:
        """Whether this pass packs its datums; the reason it does not is logged once per reason."""
        reason = (None if self.pack else "packing is off (Trainer(pack=False))") or self._unpacked_reason
        if reason is None and invariant.enabled():
            reason = "batch-invariant mode (its tiles follow padded rows)"
        self.stats["padded_passes" if reason else "packed_passes"] += 1
        if reason is not None and reason not in self._logged:
            self._logged.add(reason)
            log.info("training passes pad their datums: %s", reason)
        return reason is None

    def plan_packed(self, rows: list[Row], budget: int | None = None) -> list[list[Row]]:
        """Packed micro-batches of at most `budget` tokens (default max_tokens_per_pass), datums in
        request order (a datum longer than the budget goes alone)."""
        budget = budget or self.max_tokens_per_pass
        if budget is None or sum(r.length for r in rows) <= budget:
            return [rows]
        batches: list[list[Row]] = [[]]
        used = 0
        for row in rows:
            if batches[-1] and used + row.length > budget:
                batches.append([])
                used = 0
            batches[-1].append(row)
            used += row.length
        return batches

    def plan(self, rows: list[Row], budget: int | None = None) -> list[list[Row]]:
        """Micro-batches within the token budget (default max_tokens_per_pass); longest rows first so
        rows of like length pad together."""
        budget = budget or self.max_tokens_per_pass
        if budget is None or len(rows) * max(r.length for r in rows) <= budget:
            return [rows]
        batches: list[list[Row]] = [[]]
        for row in sorted(rows, key=lambda r: -r.length):
            cur = batches[-1]
            if cur and (len(cur) + 1) * cur[0].length > budget:
                batches.append(cur := [])
            cur.append(row)
        return batches

    def _micro_batch(
        self,
        mb: list[Row],
        preps: list[_Prepared],
        backward: bool,
        logprobs: dict[tuple[int, int], np.ndarray],
        losses: dict[tuple[int, int], np.ndarray],
        loss_sum: list[float],
        alone: int,
    ) -> None:
        """One padded forward (+ backward) over `mb`; the adapters' gradients stay pending (train_commit)."""
        datums = [preps[r.req].datums[r.datum] for r in mb]
        T, K = max(r.length for r in mb), max(d.width for d in datums)
        recomputed_blocks, logits_chunk = self.memory_plan(len(mb) * T, alone)
        real = sum(r.length for r in mb)
        self.stats["tokens"] += real
        self.stats["padding_tokens"] += len(mb) * T - real
        tokens = np.zeros((len(mb), T), dtype=np.int64)
        targets = np.zeros((len(mb), T, K), dtype=np.int64)
        for i, d in enumerate(datums):
            tokens[i, : len(d.tokens)] = d.tokens
            t = d.inputs["target_tokens"]
            targets[i, : len(d.tokens), : d.width] = t if t.ndim == 2 else t[:, None]
        adapters = _unique([a for r in mb if (a := preps[r.req].adapter) is not None])
        row_adapter = row_slots = None
        if backward:
            index = {a.id: k for k, a in enumerate(adapters)}
            row_adapter = [index[preps[r.req].adapter.id] for r in mb]  # type: ignore[union-attr]
        elif adapters:
            row_slots = [a.slot if (a := preps[r.req].adapter) else -1 for r in mb]
        lp = self._forward(tokens, targets, backward, adapters, row_adapter, row_slots, recomputed_blocks,
                           logits_chunk, row_lengths=[r.length for r in mb], vision=self._vision(datums, T))
        with torch.set_grad_enabled(backward):
            total: Tensor | None = None
            els: list[tuple[list[int], int, Tensor]] = []
            for q in dict.fromkeys(r.req for r in mb):
                p = preps[q]
                idx = [i for i, r in enumerate(mb) if r.req == q]
                k_req = max(datums[i].width for i in idx)
                x, mask = pad_inputs([datums[i] for i in idx], T, self.device,
                                     fill={"weights": 1.0, **p.job.config})
                lp_q = lp if len(idx) == len(mb) else lp[torch.tensor(idx, device=self.device)]
                el = p.job.spec.fn(lp_q[..., :k_req], x, mask, p.job.config)
                total = el.sum() if total is None else total + el.sum()
                els.append((idx, q, el.detach()))
            if backward:
                self._backward(total, lp)

        lp_cpu = lp.detach().float().cpu().numpy()
        for idx, q, el in els:
            el_cpu = el.float().cpu().numpy()
            loss_sum[q] += float(el_cpu.sum(dtype=np.float64))
            for j, i in enumerate(idx):
                d, n = datums[i], len(datums[i].tokens)
                key = (q, mb[i].datum)
                one_d = d.inputs["target_tokens"].ndim == 1
                logprobs[key] = lp_cpu[i, :n, 0].copy() if one_d else lp_cpu[i, :n, : d.width].copy()
                losses[key] = el_cpu[j, :n].copy()

    def _packed_micro_batch(
        self,
        mb: list[Row],
        preps: list[_Prepared],
        backward: bool,
        logprobs: dict[tuple[int, int], np.ndarray],
        losses: dict[tuple[int, int], np.ndarray],
        loss_sum: list[float],
        alone: int,
    ) -> None:
        """One forward (+ backward) over `mb` packed end to end in one row: no padding computed.

        Datums are laid out grouped by adapter (each adapter's tokens one contiguous span for its
        LoRA); each request's loss then sees its rows padded as on the padded path (a gather of the
        packed logprobs, zeros on padding, which every loss masks)."""
        def adapter_of(r: Row) -> Adapter | None:
            return preps[r.req].adapter

        adapters = _unique([a for r in mb if (a := adapter_of(r)) is not None])
        index = {a.id: k for k, a in enumerate(adapters)}
        mb = sorted(mb, key=lambda r: index[a.id] if (a := adapter_of(r)) is not None else -1)
        datums = [preps[r.req].datums[r.datum] for r in mb]
        lengths = [r.length for r in mb]
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        N, K = sum(lengths), max(d.width for d in datums)
        self.stats["tokens"] += N
        recomputed_blocks, logits_chunk = self.memory_plan(N, alone)
        tokens = np.concatenate([np.asarray(d.tokens, dtype=np.int64) for d in datums])[None]
        targets = np.zeros((1, N, K), dtype=np.int64)
        for s, d in zip(starts, datums, strict=True):
            t = d.inputs["target_tokens"]
            targets[0, s : s + len(d.tokens), : d.width] = t if t.ndim == 2 else t[:, None]
        row_adapter = row_slots = None  # one adapter for the whole row, or one per token
        if backward:
            per_datum = [index[a.id] for r in mb if (a := adapter_of(r)) is not None]
            # one row, one adapter: the plain two-matmul LoRA
            row_adapter = [0] if len(adapters) == 1 else np.repeat(per_datum, lengths).tolist()
        elif adapters:
            slots = [a.slot if (a := adapter_of(r)) is not None else -1 for r in mb]
            row_slots = slots[:1] if len(set(slots)) == 1 else np.repeat(slots, lengths).tolist()
        lp = self._forward(tokens, targets, backward, adapters, row_adapter, row_slots, recomputed_blocks,
                           logits_chunk, packed=lengths)
        with torch.set_grad_enabled(backward):
            lp_flat = torch.cat([lp[0], lp.new_zeros(1, K)])  # row N: what padded positions read
            total: Tensor | None = None
            els: list[tuple[list[int], int, Tensor]] = []
            for q in dict.fromkeys(r.req for r in mb):
                p = preps[q]
                idx = [i for i, r in enumerate(mb) if r.req == q]
                k_req = max(datums[i].width for i in idx)
                T = max(lengths[i] for i in idx)
                gather = np.full((len(idx), T), N, dtype=np.int64)
                for j, i in enumerate(idx):
                    gather[j, : lengths[i]] = starts[i] + np.arange(lengths[i])
                lp_q = lp_flat[torch.from_numpy(gather).to(self.device)][..., :k_req]
                x, mask = pad_inputs([datums[i] for i in idx], T, self.device, fill={"weights": 1.0, **p.job.config})
                el = p.job.spec.fn(lp_q, x, mask, p.job.config)
                total = el.sum() if total is None else total + el.sum()
                els.append((idx, q, el.detach()))
            if backward:
                self._backward(total, lp)

        lp_cpu = lp.detach().float().cpu().numpy()[0]
        for idx, q, el in els:
            el_cpu = el.float().cpu().numpy()
            loss_sum[q] += float(el_cpu.sum(dtype=np.float64))
            for j, i in enumerate(idx):
                d, n, s = datums[i], lengths[i], starts[i]
                key = (q, mb[i].datum)
                one_d = d.inputs["target_tokens"].ndim == 1
                logprobs[key] = lp_cpu[s : s + n, 0].copy() if one_d else lp_cpu[s : s + n, : d.width].copy()
                losses[key] = el_cpu[j, :n].copy()

    def _vision(self, datums: list[ParsedDatum], T: int) -> VisionInput | None:
        """The micro-batch's images (vision-language bases): row i is datum i from position 0."""
        if not any(d.images is not None for d in datums):
            return None
        positions = torch.arange(T, device=self.device).expand(len(datums), T)
        segments = [(i * T, len(d.tokens), d.images) for i, d in enumerate(datums)]
        return self.model.vision_input(positions, segments, self.features)  # type: ignore[operator]

    @staticmethod
    def lora_ref(a: Adapter) -> LoraRef:
        """What a training op needs of an adapter in a slot."""
        return LoraRef(a.id, a.slot, a.rank, a.targets, a.scale)  # type: ignore[arg-type]

    def _forward(self, tokens: np.ndarray, targets: np.ndarray, backward: bool, adapters: list[Adapter],
                 row_adapter: list[int] | None, row_slots: list[int] | None, recomputed_blocks: int,
                 logits_chunk: int, packed: list[int] | None = None, row_lengths: list[int] | None = None,
                 vision: VisionInput | None = None) -> Tensor:
        """Every rank runs the forward on its share (train_forward); the target logprobs come back
        here, where the losses run."""
        return self.residency.runner.call(
            "train_forward", tokens=torch.from_numpy(tokens), targets=torch.from_numpy(targets), backward=backward,
            adapters=[self.lora_ref(a) for a in adapters] if backward else None, row_adapter=row_adapter,
            row_slots=row_slots, recomputed_blocks=recomputed_blocks, logits_chunk=logits_chunk, packed=packed,
            row_lengths=row_lengths, vision=vision)

    def _backward(self, total: Tensor | None, lp: Tensor) -> None:
        """d(loss)/d(logprobs) to every rank, which backpropagates it through its share (train_backward)."""
        grad = None if total is None else torch.autograd.grad(total, lp, allow_unused=True)[0]
        self.residency.runner.call("train_backward", grad=torch.zeros_like(lp) if grad is None else grad)

    def memory_plan(self, padded_tokens: int, alone: int) -> tuple[int, int]:
        """(blocks recomputed in backward, most logits elements at once) for a micro-batch of
        `padded_tokens`, in a pass whose largest request alone holds `alone` padded tokens."""
        blocks = self.model.config.num_layers
        blocks_kept = self._blocks_kept(padded_tokens)
        chunk = self.logits_chunk
        # Fused beyond its largest request: keep no more block activations (blocks kept × tokens) than
        # that request does alone. Not in batch-invariant mode, where a request's gradients must not
        # depend on what it was fused with (chunked logits sum its lm_head gradient in another order).
        if padded_tokens > alone and not invariant.enabled():
            blocks_kept = min(blocks_kept, self._blocks_kept(alone) * alone // padded_tokens)
            chunk = max(1, min(chunk, alone * self.vocab))
        return blocks - blocks_kept, chunk

    def _blocks_kept(self, padded_tokens: int) -> int:
        """Blocks whose activations a micro-batch of `padded_tokens` keeps within checkpoint_from_tokens:
        the most k with k × padded_tokens <= L × budget (so L − k = ceil((1 − budget/T)·L))."""
        blocks = self.model.config.num_layers
        if self.checkpoint_from_tokens is None:
            return blocks
        return min(blocks, blocks * self.checkpoint_from_tokens // max(1, padded_tokens))

    @staticmethod
    def _non_finite(aid: str) -> EngineError:
        return EngineError(f"adapter {aid!r}: the loss produced non-finite gradients (check advantages and "
                           "logprobs); nothing was accumulated")

    # --- server-side custom losses -----------------------------------------------------------
    def forward_backward_custom(self, job: CustomJob) -> Output:
        """Run an uploaded custom loss: a forward for the logprobs, the loss per datum with autograd,
        then a cross-entropy backward whose weights are −∂loss/∂logprobs, which gives the adapter
        exactly the loss's gradient (the SDK's client-side path, without the round trips)."""
        (out,) = self.run([job.forward])
        if isinstance(out, Exception):
            raise out
        logprobs = [torch.from_numpy(o["logprobs"].to_numpy().astype(np.float32)).requires_grad_(True)
                    for o in out.loss_fn_outputs]
        total, metrics = run_per_datum(job.loss, logprobs, job.inputs)
        total.backward()
        datums = tuple(
            dataclasses.replace(d, inputs={**d.inputs, "weights": -(lp.grad if lp.grad is not None else torch.zeros_like(lp))
                                           .numpy().astype(np.float32)})
            for d, lp in zip(job.forward.datums, logprobs, strict=True)
        )
        backward = dataclasses.replace(job.forward, datums=datums, backward=True)
        (result,) = self.run([backward])
        if isinstance(result, Exception):
            raise result
        surrogate = result.metrics.pop("loss:sum")
        result.metrics.update(metrics)
        result.metrics["loss:sum"] = float(total.detach())
        result.metrics["surrogate_loss:sum"] = surrogate
        return result

def target_logprobs(model: Transformer, h: Tensor, lora: LoraBatch | None, targets: Tensor,
                    logits_chunk: int) -> Tensor:
    """log p(target) [rows, T, K] in float32; huge logits tensors are built a chunk at a time.

    Above `logits_chunk` elements the positions split into the fewest even chunks within it (sizes
    differ by at most one: no runt chunk paying a full lm_head pass for a few positions). Every chunk
    but the last keeps no logits and rebuilds them in backward; the last one's backward runs first,
    right after the forward, so rebuilding it would save no peak memory.
    """
    rows, T, _ = h.shape
    chunks = -(-T // max(1, logits_chunk // (rows * model.config.vocab_size)))  # ceil
    if chunks == 1:
        return logprobs_block(model, h, targets, lora)
    parts = []
    start = 0
    for i, (hs, ts) in enumerate(zip(h.tensor_split(chunks, dim=1), targets.tensor_split(chunks, dim=1), strict=True)):
        hs = hs.contiguous()  # a strided chunk would take matmul's batched path (the weight expanded per row)
        # a packed row's per-token LoRA: this chunk's tokens
        lc = lora.window(start, start + hs.shape[1]) if isinstance(lora, TokenLora) else lora
        start += hs.shape[1]
        if torch.is_grad_enabled() and i + 1 < chunks:
            parts.append(torch.utils.checkpoint.checkpoint(logprobs_block, model, hs, ts, lc, use_reentrant=False))
        else:
            parts.append(logprobs_block(model, hs, ts, lc))
    return torch.cat(parts, dim=1)


def logprobs_block(model: Transformer, h: Tensor, targets: Tensor, lora: LoraBatch | None) -> Tensor:
    if getattr(model, "tp", None) is not None:  # vocab-parallel: never gather the [rows, T, vocab] logits
        return model.tp.target_logprobs(model.local_logits(h, lora), targets, model.vocab_start)
    return TargetLogprobs.apply(model.logits(h, lora), targets)


# --- the training pass's ops (every rank) ----------------------------------------------------------------------------
@op
def train_forward(sh: Shard, tokens: Tensor, targets: Tensor, backward: bool, adapters: list[LoraRef] | None,
                  row_adapter: list[int] | None, row_slots: list[int] | None, recomputed_blocks: int,
                  logits_chunk: int, packed: list[int] | None = None, row_lengths: list[int] | None = None,
                  vision: VisionInput | None = None) -> Tensor:
    """Target logprobs [rows, T, K] (replicated); with backward, the graph waits for `train_backward`.

    The LoRA: with backward, trainable leaves over `adapters` by `row_adapter` (`training_lora`: per
    layer, not [n, layers, …] stacks, whose per-layer slices would each zero-fill a whole-stack
    gradient in backward, O(L²) memory traffic); without, the bank's `row_slots`. Each is per row, or, for one packed row (`packed`: its datums' lengths), one entry
    for the whole row or one per token. row_lengths: a padded batch's real lengths (batch-invariant
    mode tiles by them); vision: the rows' images (vision bases)."""
    leaves = None
    lora: LoraBatch | None = None
    if backward:
        lora, leaves = training_lora(sh.bank, adapters, row_adapter, sh.device, sh.dtype)  # type: ignore[arg-type]
    elif row_slots is not None:
        lora = sh.bank.batch(row_slots, sh.device)
    if packed is not None and lora is not None and lora.rows.numel() > 1:
        lora = TokenLora(weights=lora.weights, rows=lora.rows, scale=lora.scale)
    if lora is not None and row_lengths is not None:
        lora.row_lengths = row_lengths
    with torch.set_grad_enabled(backward):
        tokens = tokens.to(sh.device)
        if packed is not None:
            h = sh.model.packed_hidden_states(tokens, packed, lora, recomputed_blocks=recomputed_blocks)
        else:
            h = sh.model.hidden_states(tokens, lora=lora, recomputed_blocks=recomputed_blocks, vision=vision)
        lp = target_logprobs(sh.model, h, lora, targets.to(sh.device), logits_chunk)
    sh.pass_state = (lp, leaves) if backward else None
    return lp


@op
def train_backward(sh: Shard, grad: Tensor) -> None:
    """Backpropagate rank 0's d(loss)/d(logprobs) through every rank's share; gradients stay pending."""
    assert sh.pass_state is not None
    lp, leaves = sh.pass_state
    sh.pass_state = None
    lp.backward(grad.to(lp.device))
    accumulate(sh.pending, leaf_grads(leaves))


@op
def train_commit(sh: Shard, keep: bool) -> list[str]:
    """End of a pass: add the pending gradients to the adapters (ids whose gradients are non-finite on
    any rank are refused and returned), or drop them (`keep` False: the pass failed)."""
    pending, sh.pending, sh.pass_state = sh.pending, {}, None
    failed: list[str] = []
    if not keep:
        return failed
    for aid in sorted(pending):
        grads = pending[aid]
        finite = all(bool(torch.isfinite(g).all()) for pair in grads.values() for g in pair)
        if not sh.tp.all_true(finite):
            failed.append(aid)
            continue
        accumulate(sh.record(aid).grads, grads)
    return failed


def packing_unsupported(model: Transformer) -> str | None:
    """Why `model`'s training passes cannot pack their datums (None: they can). Packing needs the
    standard blocks, whose attention takes a PackedView (dense Llama/Qwen3, Qwen3-MoE, gpt-oss)."""
    if (refusal := family_spec(model.config).packing_refusal) is not None:
        return refusal
    if getattr(model, "tp", None) is not None:
        return "tensor parallelism (each rank's share is padded)"
    own = type(model)
    if own.hidden_states is not Transformer.hidden_states or own.run_layers is not Transformer.run_layers or any(
        type(b).forward is not Block.forward or type(getattr(b, "self_attn", None)) is not Attention
        for b in model.layers
    ):
        return f"{own.__name__}: its blocks are not the standard ones that take a PackedView"
    return None


def _unique(adapters: list[Adapter]) -> list[Adapter]:
    return list({a.id: a for a in adapters}.values())
