"""Nothing heavy on the event loop (issue 52): a prompt text too long to fit is refused before it is
tokenized, and tokenizing and chat-template rendering run on a worker thread, so `/healthz` answers
while they run. Checked by order of events (a tokenizer held mid-call), not by timing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine
from tests.tiny import make_tiny_checkpoint

AUTH = {"Authorization": f"Bearer {KEY_A}"}
BIG = "a" * (16 << 20)  # 16 MB of text
WAIT = 60  # a failure bound only: a pass never waits on it


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)
    with LiveServer(tiny_engine(model_dir), tmp_path_factory.mktemp("loop") / "data") as server:
        yield server


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", {"model": BASE, "prompt": BIG, "max_tokens": 1}, "prompt"),
    ("completions", {"model": BASE, "prompt": ["hi", BIG], "max_tokens": 1}, "prompt"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": BIG}], "max_tokens": 1}, "messages"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}],
                          "max_tokens": 1}, "messages"),
])  # fmt: skip
def test_a_16mb_prompt_is_refused_before_it_is_tokenized(live: LiveServer, path: str, body: dict, param: str) -> None:
    face = live.service.openai
    face.template  # noqa: B018  # built (its own tokenizer use done) before counting
    before = face.tokenized
    r = httpx.post(f"{live.url}/v1/{path}", json=body, headers=AUTH, timeout=WAIT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "bytes" in error["message"]
    assert face.tokenized == before  # the giant was never tokenized (nor rendered: a chat's bound comes first)
    # A prompt that fits still runs, and is tokenized once.
    ok = httpx.post(f"{live.url}/v1/completions", json={"model": BASE, "prompt": "hello", "max_tokens": 1},
                    headers=AUTH, timeout=WAIT)  # fmt: skip
    assert ok.status_code == 200 and face.tokenized == before + 1


class Held:
    """Wraps a callable: each call says it has begun, then waits until released."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        assert self.release.wait(WAIT)
        return self.inner(*args, **kw)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_healthz_answers_while_a_prompt_is_tokenized_or_rendered(live: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                                 route: str) -> None:  # fmt: skip
    face = live.service.openai
    if route == "completions":
        held = Held(face.requests._tokenize)
        monkeypatch.setattr(face.requests, "_tokenize", held)
        body: dict[str, Any] = {"model": BASE, "prompt": "hello there", "max_tokens": 2}
    else:
        held = Held(face.template.render_with_images)
        monkeypatch.setattr(face.template, "render_with_images", held)
        body = {"model": BASE, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{live.url}/v1/{route}", json=body, headers=AUTH, timeout=WAIT)
        try:
            assert held.entered.wait(WAIT), "the request never reached the tokenizer"
            # The tokenizer (or template) is mid-call and cannot return: were it on the event loop,
            # nothing else could be answered now.
            assert not held.release.is_set()
            health = httpx.get(f"{live.url}/api/v1/healthz", timeout=WAIT)
            assert health.status_code == 200
            assert not pending.done()  # still held: /healthz was answered during the tokenizing
        finally:
            held.release.set()
        assert pending.result().status_code == 200
