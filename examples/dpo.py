"""DPO: the cookbook's `train_dpo` on preference pairs made in code (no dataset download): for
"What is A + B?" the right sum is preferred to a wrong one. The reference model is the base, so
the curve shows the DPO loss falling from log 2 and the chosen-vs-rejected accuracy rising."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import chz
from tinker_cookbook.preference.preference_datasets import ComparisonDatasetBuilder
from tinker_cookbook.preference.types import Comparison, LabeledComparison

from examples.common import parser, renderer_for, write_curve


@chz.chz
class ArithmeticPreferences(ComparisonDatasetBuilder):
    """Pairs of answers to small sums, the correct one labelled preferred."""

    n_pairs: int = 512
    seed: int = 0

    def get_train_and_test_datasets(self):  # -> tuple[datasets.Dataset, None]
        import datasets

        rng = random.Random(self.seed)
        rows = []
        for _ in range(self.n_pairs):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
            rows.append({"question": f"What is {a} + {b}?", "right": f"{a} + {b} = {a + b}.",
                         "wrong": f"{a} + {b} = {wrong}."})
        return datasets.Dataset.from_list(rows), None

    def example_to_labeled_comparison(self, example: dict) -> LabeledComparison | None:
        comparison = Comparison(
            prompt_conversation=[{"role": "user", "content": example["question"]}],
            completion_A=[{"role": "assistant", "content": example["right"]}],
            completion_B=[{"role": "assistant", "content": example["wrong"]}],
        )
        return LabeledComparison(comparison=comparison, label="A")


def run(argv: list[str] | None = None) -> Path:
    p = parser("dpo", steps=30, lr=1e-4)
    p.add_argument("--batch-size", type=int, default=8, help="Preference pairs per step.")
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta.")
    args = p.parse_args(argv)
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    renderer = renderer_for(args.model, args.renderer)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model, renderer_name=renderer, max_length=256, batch_size=args.batch_size
    )
    dataset = DPODatasetBuilderFromComparisons(
        common_config=common, comparison_builder=ArithmeticPreferences(n_pairs=args.batch_size * args.steps)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    config = train_dpo.Config(
        log_path=str(args.out), model_name=args.model, recipe_name="examples_dpo", renderer_name=renderer,
        dataset_builder=dataset, learning_rate=args.lr, dpo_beta=args.beta, lora_rank=args.rank,
        base_url=args.base_url, save_every=0, eval_every=0, max_steps=args.steps,
    )
    train_dpo.main(config)
    csv_path, png = write_curve(args.out, "dpo_loss", f"DPO on {args.model}", extra=("accuracy",))
    print(f"metrics: {csv_path}\ncurve: {png}")
    return args.out


if __name__ == "__main__":
    run(sys.argv[1:])
