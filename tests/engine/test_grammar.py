"""Structured output in the sampler: grammar rows in mixed batches, through preemption, forked per
sample; on a tiny random model, whose unconstrained text is noise, so everything that parses here
parses because of the grammar."""

import json

import jsonschema
import pytest
import torch

from mint_server.engine.grammar import Grammars
from mint_server.engine.interface import EngineError
from mint_server.engine.records import SamplingRecords
from tests.engine.helpers import SamplerHarness
from tests.engine.test_sampling import drain, install, params, prompt_of

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def tokenizer(sampling_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sampling_llama_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer, model):
    return Grammars(tokenizer, model.config.vocab_size, model.config.eos_token_ids, 65536)


def make(model, residency, tokenizer, grammars, **kw) -> SamplerHarness:
    kw = {"kv_slots": 8, "max_seq_len": 120, "block_size": 8, "records": SamplingRecords(), **kw}
    return SamplerHarness(model, residency, tokenizer=tokenizer, grammars=grammars, **kw)


def text_of(tokenizer, seq) -> str:
    return tokenizer.decode(seq.tokens, skip_special_tokens=True)


def test_grammar_rows_in_a_mixed_batch_always_validate_and_leave_other_rows_alone(model, residency, tokenizer, grammars):
    """Grammar rows on two adapters and the base, greedy and seeded, n > 1 (each sample forks its own
    matcher) beside plain rows: every constrained text parses and validates, and a plain row's tokens
    are what it draws alone."""
    adapters = [install(residency, 4, seed=1), install(residency, 8, seed=2)]
    plain_p = params(temperature=1.0, seed=7, max_tokens=30)
    plain_alone = []
    for a in (adapters[0], None):
        s = make(model, residency, tokenizer, grammars)
        f = s.submit(a, prompt_of(3, 6), 1, plain_p)
        drain(s)
        plain_alone.append(f.result().sequences[0].tokens)
    sampler = make(model, residency, tokenizer, grammars)
    constrained = [
        sampler.submit(adapters[0], prompt_of(1, 5), 3, params(temperature=1.0, seed=4, max_tokens=80),
                       response_format=AS_PERSON),
        sampler.submit(adapters[1], prompt_of(2, 7), 1, params(max_tokens=80), response_format=AS_PERSON),
        sampler.submit(None, prompt_of(1, 5), 2, params(temperature=0.7, top_p=0.9, seed=5, max_tokens=80),
                       response_format=AS_PERSON),
    ]
    plain = [sampler.submit(a, prompt_of(3, 6), 1, plain_p) for a in (adapters[0], None)]
    drain(sampler)
    texts = []
    for f in constrained:
        for seq in f.result().sequences:
            assert seq.stop_reason == "stop"  # the grammar completed (its text can go no further)
            text = text_of(tokenizer, seq)
            jsonschema.validate(json.loads(text), PERSON)
            texts.append(text)
    assert len(set(texts[:3])) > 1  # the three seeded samples of one request drew apart
    assert [f.result().sequences[0].tokens for f in plain] == plain_alone
    assert all(seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
               for f in constrained for seq in f.result().sequences)


def test_same_seed_same_structured_output(model, residency, tokenizer, grammars):
    p = params(temperature=1.0, seed=11, max_tokens=80)
    runs = []
    for _ in range(2):
        s = make(model, residency, tokenizer, grammars)
        f = s.submit(None, prompt_of(9, 6), 2, p, response_format=AS_PERSON)
        drain(s)
        runs.append([(list(q.tokens), list(q.logprobs)) for q in f.result().sequences])
    assert runs[0] == runs[1]


def test_preempted_grammar_rows_keep_their_matcher(model, residency, tokenizer, grammars):
    """Grammar rows swapped out for another key's request resume where they were: the same tokens
    as alone, and still valid."""
    heavy_p = params(temperature=1.0, seed=11, max_tokens=40)
    prompts = [prompt_of(40 + i, 6) for i in range(3)]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 12, "maxItems": 12}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}

    def alone(prompt):
        s = make(model, residency, tokenizer, grammars, kv_slots=3, max_seq_len=48)
        f = s.submit(None, prompt, 1, heavy_p, response_format=fmt)
        drain(s)
        return f.result().sequences[0].tokens

    expected = [alone(pr) for pr in prompts]
    sampler = make(model, residency, tokenizer, grammars, kv_slots=3, max_seq_len=48)
    heavy = [sampler.submit(None, pr, 1, heavy_p, key="heavy", response_format=fmt) for pr in prompts]
    for _ in range(5):
        sampler.step()
    assert sampler.pool.available == 0
    quiet = sampler.submit(None, prompt_of(50, 5), 1, params(max_tokens=8), key="quiet")
    drain(sampler)
    assert sampler.stats.preempted >= 1 and sampler.stats.resumed == sampler.stats.preempted and quiet.done()
    for f, tokens in zip(heavy, expected, strict=True):
        seq = f.result().sequences[0]
        assert seq.tokens == tokens
        jsonschema.validate(json.loads(text_of(tokenizer, seq)), schema)


@pytest.mark.parametrize(
    ("fmt", "check"),
    [
        ({"type": "regex", "regex": "[a-c]{2,4}-[0-9]{2}"}, lambda t: len(t) in (5, 6, 7) and t[-3] == "-"),
        ({"type": "lark", "lark": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'},
         lambda t: t in ("yes", "no") or (t.startswith("maybe ") and t[-1].isdigit())),
        ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
        ({"type": "json_schema", "json_schema": {"schema": {"enum": ["red", "green"]}}, "prefix": "colour: ",
          "suffix": "."}, lambda t: t in ('colour: "red".', 'colour: "green".')),
    ],
)
def test_regex_lark_json_object_and_literal_text_around_json(model, residency, tokenizer, grammars, fmt, check):
    sampler = make(model, residency, tokenizer, grammars)
    # json_object: any object; a random model's keys run long, so steer it to close quickly
    bias = {str(tokenizer.convert_tokens_to_ids("}")): 8.0} if fmt["type"] == "json_object" else None
    f = sampler.submit(None, prompt_of(5, 4), 4, params(temperature=1.0, seed=3, max_tokens=100),
                       response_format=fmt, logit_bias=bias)
    drain(sampler)
    for seq in f.result().sequences:
        assert seq.stop_reason == "stop"
        text = text_of(tokenizer, seq)
        assert check(text), text


@pytest.mark.parametrize(
    ("fmt", "fragment"),
    [
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format: must be an object"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 5}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "nmae": "x"}}, "response_format.json_schema.nmae"),
        ({"type": "json_object", "regex": "a"}, "response_format.regex"),
        ({"type": "regex", "regex": "(ab"}, "response_format"),
        ({"type": "lark", "lark": "start: undefined_rule"}, "response_format"),
        ({"type": "regex", "regex": "a" * 70000}, "at most 65536"),
    ],
)
def test_bad_response_format_is_refused_naming_the_field(model, residency, tokenizer, grammars, fmt, fragment):
    sampler = make(model, residency, tokenizer, grammars)
    with pytest.raises(EngineError, match="sampling_params.response_format") as err:
        sampler.submit(None, [5, 6], 1, params(), response_format=fmt)
    assert fragment in str(err.value)
    assert not sampler.has_work()


def test_an_engine_without_grammars_refuses_response_format(model, residency):
    sampler = SamplerHarness(model, residency)
    with pytest.raises(EngineError, match="needs a tokenizer"):
        sampler.submit(None, [5, 6], 1, params(), response_format={"type": "json_object"})


def test_masks_mark_exactly_what_the_grammar_allows(tokenizer, grammars):
    """The bitmask's bits against the grammar's own verdict per token: after '{"a": ' with an
    integer value, digits and '-' are allowed, letters and quotes are not."""
    g = grammars.parse({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}}}, "response_format")
    m = grammars.start(g)
    for t in tokenizer('{"a": ', add_special_tokens=False)["input_ids"]:
        assert not grammars.advance(m, t)
    bits = grammars.masks([m])
    allowed = ((bits[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: grammars.vocab_size]
    vocab = {tokenizer.convert_ids_to_tokens(i): i for i in range(len(tokenizer))}
    for piece, ok in (("1", True), ("7", True), ("-", True), ("a", False), ('"', False), ("}", False)):
        assert bool(allowed[vocab[piece]]) is ok, piece
    assert not any(allowed[t] for t in (1,))  # a special token (<|im_start|>) never
