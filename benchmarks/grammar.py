"""Structured output: the grammar libraries side by side, and what grammar rows cost a decode step.

    python -m benchmarks.grammar [--rows 8,32] [--steps 12] [--skip-libraries]

A. Libraries (llguidance, which the engine uses, and xgrammar when it is installed), on SmolLM2's
   49152-token vocabulary:
   - tokenizer preparation (once per engine) and compile time of each schema (cold: no cache);
   - per-step mask cost: a valid instance of each schema, in the engine's JSON layout and tokenized
     as SmolLM2 tokenizes it (what a constrained decode draws), replayed through each library's
     matcher: fill the next-token bitmask, then accept the token — exactly a grammar row's work per
     step (mean, median, p99, max in µs);
   - validity: WALKS (50) random walks of each library's mask (a uniformly random allowed token each step)
     for a schema with bounded strings, and the share of finished texts `json.loads` rejects.
B. The engine's decode step on SmolLM2 with R rows: all plain, all with a grammar, half and half
   (seeded temperature-1 draws; EOS biased off so every row runs all steps), stepped in turn, one
   step each (load-robust). Medians of the step and of the sampler's token choice (`_advance`: masks,
   draw, matcher updates), the ratio grammar / plain, and the grammar's cost per row per step.

Prints as it goes, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
from tinker import types

from benchmarks.common import load_average, machine_floors, smollm2_dir

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "email": {"type": "string"}},
               "required": ["name", "age", "email"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "items", "status"],
               "properties": {"user": {"$ref": "#/$defs/user"}, "status": {"enum": ["ok", "error", "pending"]},
                              "items": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "number"}]},
                                        "maxItems": 4}},
               "$defs": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
                                  "properties": {"id": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}}},
    "bounded": {"type": "object", "additionalProperties": False, "required": ["code", "n"],
                "properties": {"code": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 999}}},
}
INSTANCES = {
    "person": {"name": "John Smith", "age": 40, "email": "john.smith@example.com"},
    "nested": {"user": {"id": 1234, "tags": ["admin", "early adopter"]}, "items": ["first item", 3.25, "x"],
               "status": "pending"},
    "bounded": {"code": "a1-b2", "n": 404},
}
PROMPT = "Reply with a JSON object describing a person."
NO_EOS = -100.0  # rows in part B never stop on their own
WALKS = 50


def chat_prompt(tok: Any) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def us(xs: list[float]) -> dict[str, float]:
    return {"mean_us": 1e6 * statistics.mean(xs), "median_us": 1e6 * statistics.median(xs),
            "p99_us": 1e6 * percentile(xs, 0.99), "max_us": 1e6 * max(xs)}


# --- A: the libraries ------------------------------------------------------------------------------

class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        from mint_server.engine.grammar import JSON_LAYOUT

        self.lib, self.fill_mask = llguidance, llguidance.torch.fill_next_token_bitmask
        self.layout = JSON_LAYOUT
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
        self.prepare_s = time.perf_counter() - t0
        self.mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        grammar = self.lib.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": self.layout})
        template = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        template.compute_bitmask()  # as the engine does (grammar.Grammars): samples copy a warm template
        return template

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any) -> None:
        self.fill_mask(m, self.mask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int, eos: list[int]) -> None:
        import xgrammar

        self.lib = xgrammar
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        self.prepare_s = time.perf_counter() - t0
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.mask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()


def allowed_tokens(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def libraries(tok: Any, vocab: int, eos: list[int], streams: dict[str, list[int]]) -> dict[str, Any]:
    libs: list[Any] = [LLGuidance(tok, vocab, eos)]
    try:
        libs.append(XGrammar(tok, vocab, eos))
    except ImportError:
        print("xgrammar is not installed: measuring llguidance alone")
    out: dict[str, Any] = {}
    for lib in libs:
        res: dict[str, Any] = {"tokenizer_prepare_s": lib.prepare_s, "compile_ms": {}, "replay": {}}
        steps: list[float] = []
        for name, schema in SCHEMAS.items():
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                compiled = lib.compile(schema)
                times.append(time.perf_counter() - t0)
            res["compile_ms"][name] = 1e3 * statistics.median(times)
            if name not in streams:
                continue
            m, per, accepted = lib.matcher(compiled), [], True
            for token in streams[name]:  # a grammar row's work per step: its mask, then its token
                t0 = time.perf_counter()
                lib.fill(m)
                ok = lib.accept(m, token)
                per.append(time.perf_counter() - t0)
                if not ok:
                    accepted = False
                    break
            steps += per
            res["replay"][name] = {"tokens": len(per), "accepted": accepted, **us(per)}
        res["per_step"] = us(steps)
        # validity: random walks of the mask for the bounded schema, checked by json.loads
        compiled = lib.compile(SCHEMAS["bounded"])
        invalid = finished = 0
        for seed in range(WALKS):
            rng, m, walk = random.Random(seed), lib.matcher(compiled), []
            for _ in range(60):
                lib.fill(m)
                token = rng.choice(allowed_tokens(lib.mask, vocab))
                lib.accept(m, token)
                walk.append(token)
                if lib.done(m):
                    break
            if lib.done(m):
                finished += 1
                try:
                    json.loads(tok.decode(walk, skip_special_tokens=True))
                except ValueError:
                    invalid += 1
        res["random_walks"] = {"finished": finished, "invalid_json": invalid}
        out[lib.name] = res
        print(f"{lib.name:10s} tokenizer {lib.prepare_s:.2f} s; compile ms "
              + ", ".join(f"{k} {v:.2f}" for k, v in res["compile_ms"].items())
              + f"; per step mean {res['per_step']['mean_us']:.1f} µs median {res['per_step']['median_us']:.1f} "
              f"p99 {res['per_step']['p99_us']:.1f} max {res['per_step']['max_us']:.1f}; "
              f"random walks {finished} finished, {invalid} invalid JSON", flush=True)
    return out


# --- B: the engine's decode step -------------------------------------------------------------------

def engine_steps(model: Any, tok: Any, grammars: Any, rows: int, steps: int) -> dict[str, Any]:
    from tests.engine.helpers import AdapterRegistry, SamplerHarness

    residency = AdapterRegistry(model.config, num_slots=1, max_rank=8)
    eos = model.config.eos_token_ids
    prompt = chat_prompt(tok)
    # an open JSON list of strings: it never completes, so every row runs all steps
    fmt = {"type": "lark", "lark": 'start: "[" item (", " item)*\nitem: %json {"type": "string"}'}
    workloads = {"plain": 0, "grammar": rows, "mixed": rows // 2}
    samplers, advance_s, step_s = {}, {k: [] for k in workloads}, {k: [] for k in workloads}
    for name, constrained in workloads.items():
        s = SamplerHarness(model, residency, kv_slots=rows, max_seq_len=len(prompt) + steps + 8,
                           tokenizer=tok, grammars=grammars, max_step_tokens=4096)
        for i in range(rows):
            s.submit(None, prompt, 1, types.SamplingParams(max_tokens=steps + 4, temperature=1.0, seed=i, stop=[]),
                     logit_bias={str(t): NO_EOS for t in eos}, response_format=fmt if i < constrained else None)
        inner = s.sampler._advance

        def timed(rows_: list, logits: torch.Tensor, inner: Any = inner, name: str = name) -> None:
            t0 = time.perf_counter()
            inner(rows_, logits)
            advance_s[name].append(time.perf_counter() - t0)

        s.sampler._advance = timed  # type: ignore[method-assign]
        s.step()  # the prefill (and each row's first token)
        samplers[name] = s
    for k in workloads:
        advance_s[k].clear()
    for _ in range(steps):
        for name, s in samplers.items():
            t0 = time.perf_counter()
            s.step()
            step_s[name].append(time.perf_counter() - t0)
            assert len(s.sampler._rows) == rows, "a row finished early"
    res: dict[str, Any] = {}
    for name in workloads:
        res[name] = {"step_ms": 1e3 * statistics.median(step_s[name]),
                     "advance_ms": 1e3 * statistics.median(advance_s[name])}
    plain, grammar = res["plain"], res["grammar"]
    res["grammar_over_plain_step"] = grammar["step_ms"] / plain["step_ms"]
    res["mixed_over_plain_step"] = res["mixed"]["step_ms"] / plain["step_ms"]
    res["grammar_cost_per_row_us"] = 1e3 * (grammar["advance_ms"] - plain["advance_ms"]) / rows
    print(f"rows {rows:3d}: step ms plain {plain['step_ms']:.1f} grammar {grammar['step_ms']:.1f} "
          f"mixed {res['mixed']['step_ms']:.1f} (grammar/plain {res['grammar_over_plain_step']:.3f}); token choice ms "
          f"plain {plain['advance_ms']:.2f} grammar {grammar['advance_ms']:.2f}: "
          f"{res['grammar_cost_per_row_us']:.0f} µs per grammar row", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip-libraries", action="store_true")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from mint_server.engine.grammar import Grammars
    from mint_server.model.loader import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    floors = machine_floors()
    print(f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{floors['matmul_flop_per_s'] / 1e9:.0f} GFLOP/s, load {load_average()}", flush=True)
    model_dir = smollm2_dir()
    model = load_model(model_dir, device="cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    grammars = Grammars(tok, cfg.vocab_size, cfg.eos_token_ids, 65536)
    result: dict[str, Any] = {"bench": "grammar", "vocab": cfg.vocab_size, "floors": floors, "load_start": load_average()}
    streams = {name: list(tok(json.dumps(obj), add_special_tokens=False)["input_ids"]) + [cfg.eos_token_ids[0]]
               for name, obj in INSTANCES.items()}
    if not args.skip_libraries:
        result["libraries"] = libraries(tok, cfg.vocab_size, list(cfg.eos_token_ids), streams)
    result["engine"] = {str(r): engine_steps(model, tok, grammars, r, args.steps) for r in map(int, args.rows.split(","))}
    result["load_end"] = load_average()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
