"""The scheduler's cost model (scheduler.StepCost) and the default prompt-chunk size, measured at
start-up on this machine by running a sampler's steps on scratch KV blocks (engine/local.py takes
them before the first step)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from mint_server.engine.batcher import Batcher
from mint_server.engine.executor import StepBatch
from mint_server.engine.kv import blocks_for
from mint_server.engine.sampler_ops import choose_tokens, uniforms
from mint_server.engine.scheduler import StepCost
from mint_server.model import kernels


def measure_step_cost(batcher: Batcher, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 4) -> StepCost:
    """The scheduler's cost model on this machine, from base-model steps on scratch blocks: decode
    batches of `sizes` rows, each with its rows' token draw (temperature 1, the costliest); one
    prefill step of 64 tokens as 8 chunks against one of 64 (a chunk's own cost); what a row's
    adapter, and a second adapter in the step, add (LoRA's own products and their launches). Each
    figure is the least of `repeats` rounds with every probe taken in turn (`kernels.fastest`: a
    spell of noise on a shared machine then slows one run of each probe, not every run of one,
    which would bend the curve or the differences). Measured at start-up: the weights' read against
    the compute, and where BLAS changes method, are the machine's. The unit is the marginal cost of
    a token at the largest size."""
    sizes = tuple(k for k in sizes if k <= batcher.max_batch_rows) or (1,)
    bs = batcher.block_size
    # a 64-token prompt, and the same as 8 chunks of their own, where the pool holds them
    chunks = max(1, min(8, (batcher.pool.available - 2 - blocks_for(64, bs)) // blocks_for(8, bs)))
    chunk_len = max(1, min(8, (batcher.pool.available - 2) * bs // (2 * chunks)))
    probe = chunks * chunk_len
    held: list[int] = []

    def alloc(n: int) -> list[int]:
        blocks = batcher.pool.alloc(n)
        held.extend(blocks)
        return blocks

    position = min(2 * batcher.block_size - 1, 31)  # decode rows a little into their context
    vocab = batcher.vocab_size

    def step(batch: StepBatch, draws: int = 0) -> Callable[[], None]:
        logits = torch.randn(draws, vocab)
        params = (torch.ones(draws), torch.zeros(draws, dtype=torch.long), torch.ones(draws))
        gens = [torch.Generator().manual_seed(i) for i in range(draws)]

        def run() -> None:
            batcher.executor.step(batch)
            if draws:
                choose_tokens(logits, *params, uniforms(gens))

        return run

    def decode(k: int, slots: list[int] | None = None) -> Callable[[], None]:
        return step(StepBatch([0] * k, [position] * k, [1] * k, slots or [-1] * k, [row_blocks] * k,
                              list(range(k))), k)

    try:
        row_blocks = alloc(2)
        runs = {("rows", k): decode(k) for k in sizes}
        runs["one"] = step(StepBatch([0] * probe, list(range(probe)), [probe], [-1], [alloc(blocks_for(probe, bs))], [0]))
        tables = [alloc(blocks_for(chunk_len, bs)) for _ in range(chunks)]
        runs["chunked"] = step(StepBatch([0] * probe, [p for _ in range(chunks) for p in range(chunk_len)],
                                         [chunk_len] * chunks, [-1] * chunks, tables, [chunks - 1]))
        # LoRA, where it matters for a protected key: one row on an adapter against one on the base,
        # and what each further adapter adds, as a busy step meets them: 2 rows on each of up to 8
        # adapters spread over the bank (past a few rows the mixed products run per adapter) against
        # the same rows on one (empty bank slots probed as adapters; on one rank only: under tensor
        # parallelism each rank's bank is its own)
        bank, spread = batcher.residency.bank, 0
        lora = batcher.executor.runner.tp.world == 1 and bank.num_slots > 0
        if lora:
            runs["base row"], runs["adapter row"] = decode(1), decode(1, [0])
            if (spread := min(8, bank.num_slots, batcher.max_batch_rows // 2)) > 1:
                slots = [round(i * (bank.num_slots - 1) / (spread - 1)) for i in range(spread)]
                runs["spread"] = decode(2 * spread, [s for s in slots for _ in range(2)])
                runs["together"] = decode(2 * spread, [0] * 2 * spread)
        with bank.probing(range(bank.num_slots), min(16, bank.max_rank)) if lora else contextlib.nullcontext():
            measured = dict(zip(runs, kernels.fastest(list(runs.values()), repeats), strict=True))
    finally:
        batcher.pool.release(held)
    times = [measured["rows", k] for k in sizes]
    one, chunked = measured["one"], measured["chunked"]
    first = measured["adapter row"] - measured["base row"] if lora else 0.0
    each = (measured["spread"] - measured["together"]) / (spread - 1) if lora and spread > 1 else 0.0
    if len(sizes) < 2:
        return StepCost.linear(0.0)
    unit = max((times[-1] - times[-2]) / (sizes[-1] - sizes[-2]), 1e-9)
    costs = [max(t / unit, 1.0) for t in times]
    for i in range(1, len(costs)):  # noise must not make a bigger batch cheaper
        costs[i] = max(costs[i], costs[i - 1] + 1e-3)
    return StepCost(sizes, tuple(costs), chunk=max(0.0, (chunked - one) / unit / max(1, chunks - 1)),
                    adapter_first=max(0.0, first / unit), adapter_each=max(0.0, each / unit), unit_s=unit)


def measure_chunk_tokens(batcher: Batcher, start: int, limit: int = 8192, share: float = 0.9) -> int:
    """The default of the tokens a step with prompt chunks may run: prompt throughput of one chunk
    (a prompt's start, on the base) at start, 2 × start, … tokens while a doubling still gains
    1 / share (else the smaller size already reaches `share` of the larger) and the KV pool holds
    both (up to `limit`); the fewest that reach `share` of the best. Each doubling times the two
    sizes in turn (`kernels.fastest`, two rounds after a warm-up): a spell of noise on one of
    them stopped the doubling early (a start-up here chose 128, where 256 prefills a long prompt
    1.3× faster)."""
    bs, rates = batcher.block_size, {}
    n = max(1, start)
    while 2 * n <= limit and blocks_for(n, bs) + blocks_for(2 * n, bs) <= batcher.pool.available:
        held = [batcher.pool.alloc(blocks_for(k, bs)) for k in (n, 2 * n)]
        try:
            small, big = kernels.fastest([
                functools.partial(batcher.executor.step, StepBatch([0] * k, list(range(k)), [k], [-1], [blocks], [0]))
                for k, blocks in zip((n, 2 * n), held, strict=True)], rounds=2)
        finally:
            for blocks in held:
                batcher.pool.release(blocks)
        rates[n] = max(rates.get(n, 0.0), n / max(small, 1e-9))
        rates[2 * n] = 2 * n / max(big, 1e-9)
        if rates[2 * n] * share < rates[n]:
            break
        n *= 2
    best = max(rates.values(), default=0.0)
    return next((k for k, r in sorted(rates.items()) if r >= share * best), start)
