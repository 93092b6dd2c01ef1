"""Incremental detokenization, stop strings and tool-call parsing, on a real byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mint_server.serving.chat import ChatError, ChatTemplate, ToolCallGate, parse_tool_calls
from mint_server.serving.text import TextStream
from tests.tiny import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    dest: Path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(dest)
    return AutoTokenizer.from_pretrained(dest)


def run(stream: TextStream, tokens: list[int]) -> list[str]:
    return [stream.push(t) for t in tokens] + [stream.finish()]


def test_multibyte_characters_are_never_split(tok) -> None:
    text = "héllo → wörld 🦊 done"
    ids = tok(text)["input_ids"]
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    deltas = run(TextStream(decode), ids)
    assert "".join(deltas) == text == decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len(text.encode()) // 2  # byte-level pieces: some tokens hold partial characters


def test_stop_strings_across_tokens_are_cut_and_held_back(tok) -> None:
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    ids = tok("hello world, hello mint")["input_ids"]
    stream = TextStream(decode, ["lo mi", "zzz"])
    deltas = run(stream, ids)
    assert "".join(deltas) == "hello world, hel" and stream.stopped
    # Nothing that later turned out to be part of the stop string was ever handed out.
    shown = ""
    for d in deltas:
        shown += d
        assert "lo mi" not in shown
    # A held-back tail that never completes a stop string comes out at the end.
    stream = TextStream(decode, ["mintX"])
    assert "".join(run(stream, ids)) == "hello world, hello mint" and not stream.stopped


def test_dangling_partial_character_comes_out_at_the_end(tok) -> None:
    ids = tok("🦊")["input_ids"]
    stream = TextStream(lambda t: tok.decode(t, skip_special_tokens=True))
    assert [stream.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.finish() == tok.decode(ids[:-1])  # replacement characters: bytes that never formed one


def test_tool_calls_are_parsed_and_streamed_content_stops_before_them() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><tool_call>{"name": "neg", "arguments": {"x": 1}}'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add.\n" and [c.name for c in calls] == ["add", "neg"]
    assert json.loads(calls[0].arguments) == {"a": 2} and calls[0].id != calls[1].id
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])

    gate = ToolCallGate()
    shown = "".join(gate.push(text[i : i + 3]) for i in range(0, len(text), 3))
    assert shown == "Let me add.\n" and gate.finish()[0] == ""
    gate = ToolCallGate()
    assert gate.push("a <tool_") == "a " and gate.finish() == ("<tool_", [])  # held, then released


def test_templates_without_tools_refuse_them(tok) -> None:
    template = ChatTemplate(tok)
    assert not template.supports_tools
    with pytest.raises(ChatError, match="does not support tools"):
        template.render([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f"}}])
    ids = template.render([{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}])
    assert tok.decode(ids) == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>assistant\n"
