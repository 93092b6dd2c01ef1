"""Each example runs a couple of steps on the tiny model and leaves its metrics CSV and curve PNG."""

from __future__ import annotations

import csv
from pathlib import Path

from tests.service.live import LiveServer


def common_args(server: LiveServer, tiny_dir: Path, out: Path, steps: int = 2) -> list[str]:
    return ["--base-url", server.url, "--model", str(tiny_dir), "--steps", str(steps), "--out", str(out)]


def check_outputs(out: Path, metric: str, steps: int) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(steps))
    assert all(r[metric] != "" for r in rows)
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return rows


def test_sft(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    from examples import sft

    out = sft.run([*common_args(server, tiny_dir, tmp_path / "sft"), "--batch-size", "4"])
    check_outputs(out, "train_mean_nll", 2)


def test_grpo_importance_sampling(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    from examples import grpo

    args = [*common_args(server, tiny_dir, tmp_path / "grpo"), "--problems", "2", "--group-size", "2"]
    out = grpo.run([*args, "--loss-fn", "importance_sampling"])
    check_outputs(out, "env/all/reward/total", 2)


def test_dpo(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    from examples import dpo

    out = dpo.run([*common_args(server, tiny_dir, tmp_path / "dpo"), "--batch-size", "2"])
    rows = check_outputs(out, "dpo_loss", 2)
    assert abs(float(rows[0]["dpo_loss"]) - 0.6931) < 1e-3  # policy == reference at the first step


def test_distill(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    from examples import distill

    args = [*common_args(server, tiny_dir, tmp_path / "distill"), "--prompts", "2", "--max-tokens", "4"]
    check_outputs(distill.run(args), "teacher_kl", 2)



def test_grpo_default_loss(server: LiveServer, tiny_dir: Path, tmp_path: Path) -> None:
    """The recipe's own default, stable_reinforce, which samples with record_stability_info."""
    from examples import grpo

    args = [*common_args(server, tiny_dir, tmp_path / "grpo"), "--problems", "2", "--group-size", "2",
            "--max-operand", "9"]
    rows = check_outputs(grpo.run(args), "env/all/correct", 2)
    assert all(r["env/all/reward/total"] != "" for r in rows)


def test_grpo_operand_range_holds_for_the_run_only() -> None:
    """--max-operand's problems stay in range; the recipe's own range is back once the run ends."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset

    from examples.grpo import operands_up_to

    def operands(dataset: ArithmeticDataset) -> set[int]:
        builders = [b for i in range(20) for b in dataset.get_batch(i)]
        return {v for b in builders for v in b.env_thunk.args[:2]}

    dataset = ArithmeticDataset(batch_size=8, renderer=None, group_size=2)  # type: ignore[arg-type]
    with operands_up_to(3):
        assert operands(dataset) == {0, 1, 2, 3}  # 320 draws: every value in range appears
    assert max(operands(dataset)) > 3


def test_run_recipe_gives_smollm2_the_chatml_renderer(tiny_dir: Path) -> None:
    from tinker_cookbook import model_info

    from examples.run_recipe import register_chatml_models

    saved = model_info.get_model_attributes
    try:
        register_chatml_models()
        assert model_info.get_recommended_renderer_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "qwen3_instruct"
        assert model_info.get_recommended_renderer_name(str(tiny_dir)) == "qwen3_instruct"
        assert model_info.get_recommended_renderer_name("Qwen/Qwen3-8B") == "qwen3"  # the table still answers
    finally:
        model_info.get_model_attributes = saved
