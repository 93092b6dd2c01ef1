"""Settings in one place: `mint serve`'s engine options, the capabilities' `engine_settings` and the
table in docs/engine.md are all generated from EngineSettings' field metadata (engine/settings.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import httpx
import pytest
import typer
from typer.testing import CliRunner

from mint_server.cli import app
from mint_server.cli.serve import engine_settings
from mint_server.engine.settings import EngineSettings, setting_infos, settings_table, with_settings_table
from tests.service.live import KEY_A, LiveServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"

# Every engine flag `mint serve` had before the options were generated: renaming or dropping one
# breaks operators' command lines, so it fails here.
ENGINE_FLAGS = {
    "--device-slots", "--adapter-slots", "--host-cache-mb", "--max-rank", "--kv-budget-tokens", "--kv-budget-mb",
    "--max-seq-len", "--max-step-tokens", "--max-chunk-tokens", "--max-slowdown", "--linger-s",
    "--step-overhead-tokens", "--train-slice-tokens", "--sample-steps-per-slice", "--max-fused-tokens",
    "--checkpoint-from-tokens", "--logits-chunk-mb", "--threads", "--tp", "--batch-invariant",
    "--no-batch-invariant", "--keep-freed-memory", "--no-keep-freed-memory", "--compile", "--prefix-cache",
    "--no-prefix-cache", "--quantize",
}
OTHER_FLAGS = {"--base-model", "--host", "--port", "--data-dir", "--db-url", "--store", "--api-key", "--no-auth",
               "--max-body-mb", "--ray", "--replicas", "--log-level", "--help"}


def serve_command() -> click.Command:
    return typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]


def test_the_docs_settings_table_is_the_generated_one() -> None:
    text = DOC.read_text()
    assert with_settings_table(text) == text, (
        "docs/engine.md's settings table differs from EngineSettings: run "
        "`python -m mint_server.engine.settings --write docs/engine.md`")
    assert all(f"| `{f.name}` |" in settings_table() for f in dataclasses.fields(EngineSettings))


def test_every_setting_says_what_it_is() -> None:
    infos = setting_infos()
    assert [i.name for i in infos] == [f.name for f in dataclasses.fields(EngineSettings)]
    for info in infos:
        assert info.help.strip() and info.default_text, info.name
        # rich (typer's help renderer) reads square brackets as markup and drops them
        assert "[" not in info.help, info.name
        assert info.type in (int, float, bool, str, Path), info
    flags = [d for i in infos for d in (*i.flag_decls, *i.deprecated_flags)]
    assert len(flags) == len(set(flags))


def test_serve_has_every_engine_flag_it_had_and_each_comes_from_its_setting() -> None:
    params = {p.name: p for p in serve_command().params}
    spelled = {o for p in params.values() for o in (*p.opts, *p.secondary_opts)}
    assert spelled == ENGINE_FLAGS | OTHER_FLAGS - {"--help"}  # click adds --help itself
    for info in setting_infos():
        if info.flag is None:
            assert info.name not in params
            continue
        option = params[info.name]
        assert option.opts[0] == info.flag and option.default is None  # unset: EngineSettings' own default
        assert info.help in option.help and f"[default: {info.default_text}]" in option.help


def test_serve_help_shows_the_generated_options_and_their_defaults() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "Engine settings" in result.output
    for flag in ENGINE_FLAGS | OTHER_FLAGS:
        assert flag in result.output, flag
    # the defaults survive rich's markup (it ate "[default: 16]" from the middle of the old help texts)
    assert "[default: 16]" in result.output and "[default: the model's context]" in result.output


def test_flags_reach_the_settings_and_bad_values_name_the_flag(tmp_path: Path) -> None:
    s = engine_settings(tmp_path, tmp_path / "cc", max_context=64, quantize="int8", prefix_cache=False, linger_s=0)
    assert (s.max_context, s.quantize, s.prefix_cache, s.linger_s) == (64, "int8", False, 0)
    assert (s.store_dir, s.compile_cache_dir) == (tmp_path, tmp_path / "cc")
    assert engine_settings(tmp_path) == EngineSettings(store_dir=tmp_path)
    for field, value, flag in [("max_context", 1, "--max-seq-len"), ("quantize", "int3", "--quantize"),
                               ("compile", "always", "--compile"), ("device_slots", 0, "--device-slots")]:
        with pytest.raises(typer.BadParameter) as err:
            engine_settings(tmp_path, **{field: value})
        assert err.value.param_hint == flag
    with pytest.raises(TypeError, match="store_dir"):  # not a flag: mint serve sets it from the data dir
        engine_settings(tmp_path, store_dir=tmp_path)


def test_the_deprecated_spelling_counts_only_where_the_flag_is_unset(tmp_path: Path) -> None:
    assert engine_settings(tmp_path, adapter_slots=3).device_slots == 3
    assert engine_settings(tmp_path, adapter_slots=3, device_slots=5).device_slots == 5


def test_serve_parses_the_generated_flags(tmp_path: Path) -> None:
    """Through click: a bad value of a generated option is a usage error naming it, before any model loads."""
    for args, flag in [(["--max-seq-len", "1"], "--max-seq-len"), (["--quantize", "int3"], "--quantize"),
                       (["--no-prefix-cache", "--tp", "2", "--batch-invariant"], "--batch-invariant")]:
        result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path), "--no-auth", *args])
        assert result.exit_code == 2 and flag in result.output, result.output


def test_capabilities_list_the_advertised_settings(tiny_dir: Path, tmp_path: Path) -> None:
    import torch

    from mint_server.engine.local import LocalEngine
    from tests.service.live import BASE, ENGINE_SETTINGS

    settings = dataclasses.replace(ENGINE_SETTINGS, max_rank=12, max_top_logprobs=5000)
    engine = LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=settings)
    with LiveServer(engine, tmp_path / "data") as server:
        caps = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A}).json()
    advertised = {i.name for i in setting_infos() if i.advertise}
    assert set(caps["engine_settings"]) == advertised
    assert caps["engine_settings"] == {
        "max_rank": 12, "max_context": 256, "max_num_samples": settings.max_num_samples,
        # bounded by the model: no more alternatives than the vocabulary has
        "max_top_logprobs": engine.limits.vocab_size, "batch_invariant": False, "quantize": "none",
    }
    assert caps["supported_models"][0]["max_context_length"] == caps["engine_settings"]["max_context"]
