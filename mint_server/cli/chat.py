"""`mint chat NAME@ALIAS`: an interactive terminal chat with a policy revision over the server's
OpenAI face, streaming each answer as it is generated. The conversation is kept until /reset."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from mint_server.cli.catalog_command import served_key

HELP = "Type a message and press Enter. /reset starts over, /exit (or Ctrl-D) quits."


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)


def stream_chat(client: Any, model: str, messages: list[dict[str, Any]], **params: Any) -> Iterator[str]:
    """Text deltas of one streamed chat completion (an httpx.Client pointed at the OpenAI face)."""
    body = {"model": model, "messages": messages, "stream": True, **{k: v for k, v in params.items() if v is not None}}
    with client.stream("POST", "chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise RuntimeError(f"{r.status_code}: {message}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", []):
                if text := choice.get("delta", {}).get("content"):
                    yield text


def chat(
    model: str = typer.Argument(..., help="What to talk to: NAME, NAME@ALIAS, NAME@N, or the base model's name."),
    server: str = typer.Option("http://127.0.0.1:8000", "--server", envvar="MINT_SERVER", help="MinT server URL."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar=["MINT_API_KEY", "TINKER_API_KEY"],
        help="API key (default $MINT_API_KEY, $TINKER_API_KEY, else <data dir>/api_key).",
    ),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Where `mint serve` keeps its api_key file."),
    system: str | None = typer.Option(None, "--system", help="A system message to start the conversation with."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="Default: the rest of the context."),
    temperature: float | None = typer.Option(None, "--temperature", min=0.0, help="Default: the server's (1.0)."),
    seed: int | None = typer.Option(None, "--seed"),
) -> None:
    """Chat with a policy in the terminal; answers stream as they are generated."""
    import httpx

    key = api_key or served_key(data_dir) or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = server.rstrip("/") + "/oai/api/v1/"
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    typer.echo(f"chatting with {model} at {server}. {HELP}", err=True)
    with httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(10.0, read=None)) as client:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                typer.echo("", err=True)
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                messages = list(start)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            answer = ""
            try:
                for piece in stream_chat(client, model, messages, max_tokens=max_tokens, temperature=temperature,
                                         seed=seed):  # fmt: skip
                    answer += piece
                    typer.echo(piece, nl=False)
            except KeyboardInterrupt:  # stop this answer (closing the stream cancels it), keep chatting
                typer.echo(" [interrupted]", nl=False)
            except (RuntimeError, httpx.HTTPError) as e:
                messages.pop()
                typer.echo(f"error: {e}", err=True)
                continue
            typer.echo("")
            messages.append({"role": "assistant", "content": answer})
