"""`mint generate`: one completion from the base model (optionally with a PEFT adapter) on stdout."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


def generate(
    prompt: str = typer.Option(..., "--prompt", help="Prompt text."),
    base_model: str | None = typer.Option(None, "--base-model", help="Model name or HF checkpoint dir."),
    adapter: Path | None = typer.Option(None, "--adapter", help="PEFT LoRA adapter dir."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    seed: int | None = typer.Option(None, "--seed"),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="Data dir (default $MINT_HOME or ~/.mint)."),
) -> None:
    """Print only the completion text to stdout; logs go to stderr."""
    from tinker import types

    from mint_server.engine.interface import EngineError
    from mint_server.engine.local import LocalEngine
    from mint_server.engine.settings import EngineSettings
    from mint_server.engine.values import AdapterSource
    from mint_server.model.config import ModelError
    from mint_server.model.prepare import DEFAULT_BASE_MODEL, resolve_base_model

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine = None
    try:
        model_dir = resolve_base_model(base_model, data_dir)
        name = base_model or DEFAULT_BASE_MODEL
        # compile off: one generation would wait minutes for graphs it runs a few steps of
        engine = LocalEngine(model_dir, name, settings=EngineSettings(device_slots=1, kv_budget_tokens=4096,
                                                                      max_rank=256, compile="off"))
        source = AdapterSource(f"peft:{adapter}", peft_dir=Path(adapter)) if adapter else None
        tok = engine.tokenizer
        if chat:
            tokens = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            tokens = list(tokens["input_ids"] if isinstance(tokens, dict) else tokens)
        else:
            tokens = tok(prompt)["input_ids"]
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        out = engine.submit(engine.prepare_sample(source, tokens, 1, params)).result()
    except (ModelError, EngineError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    finally:
        if engine is not None:
            engine.shutdown()
    seq = out.sequences[0]
    typer.echo(tok.decode(seq.tokens, skip_special_tokens=True))
