"""tinker-cookbook 0.6.1's distillation recipes run offline against a live server (tiny checkpoint):
`recipes/sdft/train.py` (self-distillation: the teacher's top-K prompt logprobs as soft
cross-entropy targets, forward and reverse KL) and `recipes/distillation/off_policy_reasoning.py`
(SFT on reasoning traces). Each is driven through its own `CLIConfig` and `cli_main`; the
datasets they download are replaced through the recipes' own local hooks (an Arrow dir for SDFT's
`toolalpaca_data_path`, a local JSONL dataset dir standing where OpenThoughts3's hub id points)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mint_server.engine.local import LocalEngine
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer
from tests.tiny import TINY_VOCAB
from tests.tolerance import Tolerance

# The ChatML renderer the cookbook gives SmolLM2, whose template the tiny tokenizer shares.
RENDERER = "qwen3_instruct"
QUESTIONS = ["hello world, what is 1 2 3?", "the quick brown fox jumps over what?", "count 4 5 6", "hello mint"]
ANSWERS = ["4 5 6", "the lazy dog", "7 8 9 10", "hello world"]


@pytest.fixture
def wide_server(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveServer]:
    """The tiny model with room for the recipes' prompts: SDFT's teacher prompt holds the question,
    the golden answer and a template around them, ~200 tokens of this byte-level tokenizer."""
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    engine = LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32,
                         settings=dataclasses.replace(ENGINE_SETTINGS, max_context=1024))
    with LiveServer(engine, tmp_path / "data") as server:
        monkeypatch.setenv("TINKER_BASE_URL", server.url)
        yield server


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def read_metrics(log_path: Path) -> list[dict]:
    return read_jsonl(log_path / "metrics.jsonl")


def assert_final_checkpoint_saved(log_path: Path) -> None:
    """The recipe's last act: its final state saved on the server, recorded with a tinker:// path."""
    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://"), final


def toolalpaca_dir(tmp_path: Path) -> Path:
    """SDFT's ToolAlpaca loader reads a local Arrow dataset (`toolalpaca_data_path`) instead of the hub."""
    import datasets

    path = tmp_path / "toolalpaca"
    datasets.Dataset.from_dict({"prompt": QUESTIONS * 3, "golden_response": ANSWERS * 3}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("reverse", [False, True], ids=["forward_topk", "reverse_topk"])
def test_sdft_recipe_runs_against_the_server(wide_server: LiveServer, tiny_dir: Path, tmp_path: Path,
                                             reverse: bool) -> None:
    """Two SDFT steps: the student samples, the teacher (the base model prompted with the golden
    answer) returns its top-K prompt logprobs over the student's completion, and the student trains
    on them — cross_entropy with (N, K) targets (forward), or forward_backward_custom (reverse)."""
    from tinker_cookbook.recipes.sdft import train

    data_path = toolalpaca_dir(tmp_path)
    log_path = tmp_path / "sdft"
    config = train.CLIConfig(
        model_name=str(tiny_dir), renderer_name=RENDERER, lora_rank=4, dataset="toolalpaca",
        toolalpaca_data_path=str(data_path), groups_per_batch=2, group_size=1, learning_rate=1e-3,
        max_tokens=8, topk=4, reverse=reverse, max_context_length=1024, eval_every=0, save_every=0,
        log_path=str(log_path), base_url=wide_server.url, max_steps=2, behavior_if_log_dir_exists="delete",
    )
    asyncio.run(train.cli_main(config))

    rows = read_metrics(log_path)
    assert [r["progress/batch"] for r in rows] == [0, 1]
    for row in rows:
        assert row["sdft/topk"] == 4.0 and row["sdft/num_datums"] == 2.0
        # the teacher answered top-K prompt logprobs at the completion's positions
        assert row["sdft/mean_teacher_entropy"] > 0
        if reverse:
            assert row["sdft/reverse_kl_positions"] > 0 and math.isfinite(row["loss:sum"])
        else:
            assert row["sdft/total_completion_tokens"] > 0
    assert_final_checkpoint_saved(log_path)


def test_sdft_importance_sampling_fallback(wide_server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    """SDFT's deprecated topk=0 path: per-token advantages from the teacher's compute_logprobs. The
    recipe's CLI leaves sdft.Config.loss_fn at cross_entropy, so its datums carry advantages and
    logprobs into a loss that takes target_tokens and weights: the server refuses them with a 400
    naming the field (as it does any key a loss does not read). With the loss the path is written for,
    importance_sampling, through sdft.main and the recipe's own dataset builder, it trains."""
    import tinker
    from tinker_cookbook.distillation import sdft
    from tinker_cookbook.recipes.sdft import train
    from tinker_cookbook.recipes.sdft.datasets import ToolAlpacaSDFTBuilder

    data_path = toolalpaca_dir(tmp_path)
    common = dict(renderer_name=RENDERER, lora_rank=4, learning_rate=1e-3, max_tokens=8, topk=0,
                  max_context_length=1024, eval_every=0, save_every=0, base_url=wide_server.url, max_steps=2)
    with pytest.raises(tinker.BadRequestError, match=r"datums\[0\]\.loss_fn_inputs: unexpected key '(advantages|logprobs)' for loss 'cross_entropy'"):
        asyncio.run(train.cli_main(train.CLIConfig(
            model_name=str(tiny_dir), dataset="toolalpaca", toolalpaca_data_path=str(data_path), groups_per_batch=2,
            log_path=str(tmp_path / "cli"), behavior_if_log_dir_exists="delete", **common)))

    builder = ToolAlpacaSDFTBuilder(groups_per_batch=2, model_name_for_tokenizer=str(tiny_dir), renderer_name=RENDERER,
                                    data_path=str(data_path))
    train_dataset, _ = asyncio.run(builder())
    log_path = tmp_path / "is"
    config = sdft.Config(model_name=str(tiny_dir), recipe_name="recipe_sdft", loss_fn="importance_sampling",
                         log_path=str(log_path), **common)
    asyncio.run(sdft.main(config, train_dataset))

    rows = read_metrics(log_path)
    assert [r["progress/batch"] for r in rows] == [0, 1]
    # the teacher's compute_logprobs of the student's tokens made the advantages (teacher lp - student lp)
    for r in rows:
        assert r["sdft/num_datums"] == 2.0 and r["sdft/mean_teacher_lp"] < 0 and r["sdft/mean_student_lp"] < 0, r
        # means over the batch's completion tokens (2 × max_tokens 8)
        Tolerance(n=16).check(r["sdft/mean_advantage"], r["sdft/mean_teacher_lp"] - r["sdft/mean_student_lp"],
                              "mean advantage")
    assert_final_checkpoint_saved(log_path)


def test_off_policy_reasoning_recipe_runs_against_the_server(server: LiveServer, tiny_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SFT steps on reasoning traces in OpenThoughts3's row format (from/value turns). The
    recipe loads its data with `datasets.load_dataset("open-thoughts/OpenThoughts3-1.2M",
    streaming=True)`; a local dir of that name (a train.jsonl) in the working directory is what
    `load_dataset` reads before it would ask the hub."""
    from tinker_cookbook.recipes.distillation import off_policy_reasoning as recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    local = tmp_path / "open-thoughts" / "OpenThoughts3-1.2M"
    local.mkdir(parents=True)
    with open(local / "train.jsonl", "w") as f:
        for q, a in zip(QUESTIONS, ANSWERS, strict=True):
            f.write(json.dumps({"conversations": [{"from": "human", "value": q},
                                                  {"from": "gpt", "value": f"<think>\n{q}\n</think>\n\n{a}"}]}) + "\n")
    monkeypatch.chdir(tmp_path)
    log_path = tmp_path / "off_policy"
    config = recipe.CLIConfig(
        model_name=str(tiny_dir), renderer_name=RENDERER, lora_rank=4, batch_size=2, learning_rate=1e-3,
        max_length=128, buffer_size=4, max_prompts=len(QUESTIONS), eval_every=0, save_every=0,
        log_path=str(log_path), base_url=server.url, behavior_if_log_dir_exists="delete",
    )
    recipe.cli_main(config)

    rows = read_metrics(log_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["num_sequences"] == 2 and math.isfinite(r["train_mean_nll"]) and r["train_mean_nll"] > 0
               for r in rows)
    assert_final_checkpoint_saved(log_path)


def test_on_policy_distillation_recipe_runs_against_the_server(server: LiveServer, tiny_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two on-policy distillation steps, the teacher the same base model (the server serves one):
    the student samples, the teacher's logprobs of the samples make the reverse-KL advantages, and
    importance_sampling trains on them. DeepMath's hub id points at a local dir of prompts."""
    from tinker_cookbook.recipes.distillation import on_policy_distillation as recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    local = tmp_path / "zwhe99" / "DeepMath-103K"
    local.mkdir(parents=True)
    with open(local / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"question": q}) + "\n" for q in QUESTIONS)
    monkeypatch.chdir(tmp_path)
    log_path = tmp_path / "on_policy"
    config = recipe.CLIConfig(
        model_name=str(tiny_dir), teacher_model=str(tiny_dir), renderer_name=RENDERER, lora_rank=4,
        dataset="deepmath", group_size=2, groups_per_batch=2, learning_rate=1e-3, max_tokens=8, eval_every=0,
        save_every=0, log_path=str(log_path), base_url=server.url, max_steps=2, behavior_if_log_dir_exists="delete",
    )
    asyncio.run(recipe.cli_main(config))

    rows = read_metrics(log_path)
    assert [r["progress/batch"] for r in rows] == [0, 1]
    # at the first step the student (a fresh LoRA, B = 0) is the teacher: their logprobs of the
    # samples agree to rounding, so the KL the recipe measures is 0
    Tolerance(n=TINY_VOCAB, depth=2).check(rows[0]["teacher_kl"], 0.0, "teacher_kl at step 0")
    assert_final_checkpoint_saved(log_path)
