"""The compiled serving step (model/compiled.py): decode steps and steps with prefill chunks give the
eager step's logits within the tolerance policy — mixed adapters and base rows, chunks beside decode
rows, chunks that start mid-prompt on prefix-cached blocks — and a long mixed workload compiles
nothing after the warm-up. Each test compiles (inductor, tens of seconds on 2 cores), so the set is
small."""

from __future__ import annotations

import random

import pytest
import torch

from mint_server.engine.executor import Executor, StepBatch, step
from mint_server.model.compiled import CompileStats, StepGraph, unsupported
from mint_server.model.loader import load_model
from mint_server.model.lora import LoraBank, LoraBatch, init_lora_weights, target_shapes
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import Tolerance

BS = 4  # small blocks: rows cross block boundaries within a few tokens


def _executor(model_dir, slots: int = 4) -> tuple[Executor, LoraBank]:
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    bank = LoraBank(model.config, slots, 8, "cpu", torch.float32)
    for s in range(slots):  # every slot a different nonzero adapter of rank 1 + s
        w = init_lora_weights(target_shapes(model.config), tuple(bank.shapes), 1 + s, seed=s, dtype=torch.float32)
        w = {t: (a, torch.randn_like(b) * 0.1) for t, (a, b) in w.items()}
        bank.write(s, w, 1 + s, alpha=2.0 * (1 + s))
    ex = Executor(model, bank, torch.device("cpu"), num_blocks=64, block_size=BS, compile="auto")
    assert ex.graph is not None
    ex.graph.warm_up()
    assert ex.graph.ready
    return ex, bank


def _prefill(ex: Executor, prompts: list[list[int]], slots: list[int], tables: list[list[int]]) -> None:
    batch = StepBatch(tokens=[t for p in prompts for t in p], positions=[i for p in prompts for i in range(len(p))],
                      lengths=[len(p) for p in prompts], slots=slots, tables=tables, logits_at=[])
    ex.step(batch)


def _check_compiled(ex: Executor, batch: StepBatch, what: str) -> None:
    """The step runs compiled, and its logits (every segment's last token) are the eager step's over
    the same KV (the eager run rewrites the step's own positions with its own keys)."""
    before = ex.compile_stats.compiled_steps
    got = ex.step(batch).logits
    assert ex.compile_stats.compiled_steps == before + 1, ex.compile_stats.eager_steps
    want = ex.call("step", batch=batch).logits
    Tolerance(n=ex.rank.model.config.vocab_size, depth=2).check(got, want, what)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A Llama-family executor with its decode step compiled (each compile costs tens of seconds on
    2 cores, so one per module; Qwen3's norms on q and k get the parity test below)."""
    return _executor(make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), family="llama", layers=2))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_prefill_and_decode_agree_with_eager(family, compiled, tmp_path):
    ex, bank = compiled if family == "llama" else _executor(make_tiny_checkpoint(tmp_path, family=family, layers=2))
    rng = random.Random(0)
    slots = [0, 2, -1, 3, 0, -1]  # mixed adapters, a repeated one and base rows
    lengths = [5, 9, 3, 14, 1, 7]
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in lengths]
    tables = [list(range(1 + 5 * i, 1 + 5 * i + 5)) for i in range(len(prompts))]
    prefill = StepBatch(tokens=[t for p in prompts for t in p], positions=[i for p in prompts for i in range(len(p))],
                        lengths=lengths, slots=slots, tables=tables, logits_at=list(range(len(prompts))))
    _check_compiled(ex, prefill, "prefill of six prompts")
    before = ex.compile_stats.compiled_steps
    for rows in (6, 1, 3):  # many rows, one row (its own graph), a few
        decode = StepBatch(tokens=[rng.randrange(1, 300) for _ in range(rows)], positions=lengths[:rows],
                           lengths=[1] * rows, slots=slots[:rows], tables=tables[:rows], logits_at=list(range(rows)))
        got = ex.step(decode).logits
        want = ex.call("step", batch=decode).logits  # the eager step over the same KV
        Tolerance(n=ex.rank.model.config.vocab_size, depth=2).check(got, want, f"{rows} rows")
        lengths = [n + 1 if i < rows else n for i, n in enumerate(lengths)]
    assert ex.compile_stats.compiled_steps == before + 3


def test_compiled_chunks_beside_decode_rows_and_on_cached_prefixes(compiled):
    """Steps with prefill chunks run compiled and agree with eager: a chunk on the base beside decode
    rows on adapters (chunked prefill's usual step), a second chunk continuing its prompt, a prompt
    whose first blocks are another's cached prefix (its chunk starts mid-prompt, reading blocks it
    did not write), and chunks only on the base (the variant without LoRA)."""
    ex, bank = compiled
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (6, 3, 13)]
    tables = [[10, 11], [12, 13], [14, 15, 16, 17]]
    slots = [1, 3, -1]
    _prefill(ex, prompts[:2], slots[:2], tables[:2])
    # decode rows on two adapters beside the third prompt's first chunk (on the base)
    _check_compiled(ex, StepBatch(tokens=[7, 8] + prompts[2][:5], positions=[6, 3, 0, 1, 2, 3, 4], lengths=[1, 1, 5],
                                  slots=slots, tables=tables, logits_at=[0, 1, 2]), "decode rows beside a chunk")
    # the prompt's next chunk (from position 5, across a block boundary) beside the same decode rows
    _check_compiled(ex, StepBatch(tokens=[9, 10] + prompts[2][5:], positions=[7, 4, *range(5, 13)], lengths=[1, 1, 8],
                                  slots=slots, tables=tables, logits_at=[0, 1, 2]), "a later chunk beside decode rows")
    # prefix cache: the first 12 positions (3 blocks of 4) are the third prompt's; a new sequence on
    # adapter 2 shares them and computes only its own tail from position 12
    tail = [rng.randrange(1, 300) for _ in range(5)]
    _check_compiled(ex, StepBatch(tokens=tail, positions=list(range(12, 17)), lengths=[5], slots=[2],
                                  tables=[[14, 15, 16, 18, 19]], logits_at=[0]), "a chunk on a cached prefix")
    # chunks on the base only: the prefill graph without the LoRA ops
    base = [[rng.randrange(1, 300) for _ in range(n)] for n in (4, 9)]
    _check_compiled(ex, StepBatch(tokens=base[0] + base[1], positions=[*range(4), *range(9)], lengths=[4, 9],
                                  slots=[-1, -1], tables=[[20], [21, 22, 23]], logits_at=[0, 1]), "base chunks")


def test_prompt_scoring_runs_eagerly_with_its_reason(compiled):
    ex, _ = compiled
    before = ex.compile_stats.eager_steps["prompt scoring"]
    ex.step(StepBatch(tokens=[3, 4, 5], positions=[0, 1, 2], lengths=[3], slots=[0], tables=[[30]], logits_at=[0],
                      scoring=[(0, [4, 5, 6], 0)]))
    assert ex.compile_stats.eager_steps["prompt scoring"] == before + 1


def test_adapter_matters_in_compiled_step(compiled):
    """A row's adapter reaches the compiled step: the same token on two slots gives other logits,
    and on slot -1 the base's (what the eager step gives without any LoRA)."""
    ex, bank = compiled
    prompt = [5, 6, 7, 8]
    tables = [[40], [41], [42]]
    _prefill(ex, [prompt] * 3, [1, 2, -1], tables)
    decode = StepBatch(tokens=[9] * 3, positions=[4] * 3, lengths=[1] * 3, slots=[1, 2, -1],
                       tables=[[40, 43], [41, 44], [42, 45]], logits_at=[0, 1, 2])
    got = ex.step(decode).logits
    assert (got[0] - got[1]).abs().max() > 1e-3
    want = ex.call("step", batch=decode).logits
    Tolerance(n=ex.rank.model.config.vocab_size, depth=2).check(got, want, "per-row adapters")


def test_mixed_workload_never_recompiles(compiled):
    """500 steps: rows 1..24 on any slot or the base, prefill chunks beside decode rows,
    adapters rewritten in their slots, a training forward/backward through the bank: after the
    warm-up no step compiles again."""
    ex, bank = compiled
    model = ex.rank.model
    rng = random.Random(1)
    graphs = ex.compile_stats.graphs
    compiled_before = ex.compile_stats.compiled_steps
    seqs: list[dict] = []
    next_block = [1]

    def blocks(n: int) -> list[int]:
        out = [(next_block[0] + i) % 63 + 1 for i in range(n)]
        next_block[0] += n
        return out

    for i in range(500):
        if i % 97 == 0:  # an adapter swap: a slot rewritten in place
            s = rng.randrange(bank.num_slots)
            w = init_lora_weights(target_shapes(model.config), tuple(bank.shapes), 4, seed=i, dtype=torch.float32)
            bank.write(s, {t: (a, torch.randn_like(b) * 0.1) for t, (a, b) in w.items()}, 4, alpha=8.0)
        if i % 113 == 0:  # a training slice on the same model and bank
            with torch.enable_grad():
                w = {t: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
                     for t, (a, b) in bank.batch([0, 1]).weights.items()}
                model(torch.randint(1, 300, (2, 6)), lora=LoraBatch(w, torch.tensor([0, 1]), bank.scale)).sum().backward()
        seqs = [s for s in seqs if s["len"] < 8 * BS - 1]
        rows = seqs[: rng.randrange(1, len(seqs) + 1)] if seqs else []
        step_rows = [(s, 1) for s in rows]  # (sequence, its tokens this step)
        if not seqs or len(seqs) < rng.randrange(1, 25) or i % 41 == 0:  # a new prompt, in the decode rows' step
            seqs.append({"slot": rng.choice([-1, 0, 1, 2, 3]), "len": 0, "table": blocks(8)})
            step_rows.append((seqs[-1], rng.randrange(2, 9)))
        ex.step(StepBatch(tokens=[rng.randrange(1, 300) for _, n in step_rows for _ in range(n)],
                          positions=[p for s, n in step_rows for p in range(s["len"], s["len"] + n)],
                          lengths=[n for _, n in step_rows], slots=[s["slot"] for s, _ in step_rows],
                          tables=[s["table"] for s, _ in step_rows], logits_at=list(range(len(step_rows)))))
        for s, n in step_rows:
            s["len"] += n
    assert ex.compile_stats.graphs == graphs
    assert ex.compile_stats.recompiles == 0
    assert ex.compile_stats.compiled_steps - compiled_before == 500
    assert ex.compile_stats.failures == 0


def test_families_without_a_compiled_layer_run_eagerly_with_their_reason(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "moe", family="qwen3_moe")
    model = load_model(d, device="cpu", dtype=torch.float32)
    assert unsupported(model) == "mixture-of-experts layers"
    bank = LoraBank(model.config, 2, 4, "cpu", torch.float32)
    ex = Executor(model, bank, torch.device("cpu"), num_blocks=16, block_size=BS, compile="auto")
    assert ex.graph is None
    ex.step(StepBatch(tokens=[3, 4], positions=[0, 1], lengths=[2], slots=[-1], tables=[[1]], logits_at=[0]))
    assert ex.compile_stats.eager_steps == {"mixture-of-experts layers": 1}


def test_bucketed_rows_agree_with_eager(compiled):
    """The GPU's layout on the CPU: rows and the KV window padded to powers of two (padding rows on the
    scratch block, the base) give the unpadded rows' logits."""
    ex, bank = compiled
    graph = StepGraph(ex.rank.model, bank, ex.cache, CompileStats(), buckets=True)
    graph.warm_up()
    prompts = [[11, 12, 13], [14, 15, 16, 17, 18, 19], [20]]
    tables = [[50, 51, 52], [53, 54, 55], [56, 57, 58]]
    slots = [3, -1, 1]
    _prefill(ex, prompts, slots, tables)
    decode = StepBatch(tokens=[21, 22, 23], positions=[3, 6, 1], lengths=[1] * 3, slots=slots, tables=tables,
                       logits_at=[0, 1, 2])
    hidden = graph.hidden(decode.tokens, decode.positions, decode.lengths, decode.tables, decode.slots)
    assert hidden is not None and hidden.shape[0] == 3
    got = step(ex.rank, decode, hidden).logits
    want = ex.call("step", batch=decode).logits
    Tolerance(n=ex.rank.model.config.vocab_size, depth=2).check(got, want, "bucketed rows")
