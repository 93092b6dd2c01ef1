"""GRPO on arithmetic: the cookbook's `math_rl` recipe with its arithmetic environment (problems
generated in code, so no dataset download): groups of samples per problem, reward 1 for the right
sum, advantages centred within each group. The default loss is the cookbook's, `stable_reinforce`,
which samples with `record_stability_info`; `--loss-fn importance_sampling` needs neither.

`--max-operand` sets the largest operand (the recipe's own range is 0–100). SmolLM2-135M gets a
two-digit sum right almost never, so most groups have no reward variance and give no gradient; on
one-digit sums (`--max-operand 9`) it is right ~5% of the time when sampled at temperature 1 and
~30% greedily, so groups disagree and the correct rate has room to rise (examples/README.md)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from examples.common import parser, renderer_for, write_curve

RECIPE_MAX_OPERAND = 100  # arithmetic_env draws randint(0, 101)


def run(argv: list[str] | None = None) -> Path:
    p = parser("grpo", steps=30, lr=4e-4)
    p.add_argument("--problems", type=int, default=8, help="Problems per step (groups per batch).")
    p.add_argument("--group-size", type=int, default=4, help="Samples per problem.")
    p.add_argument("--max-tokens", type=int, default=8, help="Longest answer sampled.")
    p.add_argument("--max-operand", type=int, default=RECIPE_MAX_OPERAND,
                   help=f"Largest operand of the sums (default {RECIPE_MAX_OPERAND}, the recipe's).")
    p.add_argument("--loss-fn", default=None, help="RL loss (default: the recipe's, stable_reinforce).")
    args = p.parse_args(argv)
    if args.max_operand < 0:
        p.error("--max-operand must be >= 0")
    from tinker_cookbook.recipes.math_rl import train as math_rl

    extra = {"loss_fn": args.loss_fn} if args.loss_fn else {}
    config = math_rl.CLIConfig(
        log_path=str(args.out), model_name=args.model, renderer_name=renderer_for(args.model, args.renderer),
        env="arithmetic", group_size=args.group_size, groups_per_batch=args.problems, learning_rate=args.lr,
        lora_rank=args.rank, max_tokens=args.max_tokens, max_steps=args.steps, base_url=args.base_url,
        eval_every=0, save_every=0, behavior_if_log_dir_exists="delete", **extra,
    )
    with operands_up_to(args.max_operand):
        asyncio.run(math_rl.cli_main(config))
    csv_path, png = write_curve(args.out, "env/all/correct", f"GRPO on sums to {args.max_operand}, {args.model}",
                                extra=("env/all/reward/total", "env/all/format"))
    print(f"metrics: {csv_path}\ncurve: {png}")
    return args.out


@contextlib.contextmanager
def operands_up_to(max_operand: int) -> Iterator[None]:
    """The recipe's arithmetic problems with operands in 0..max_operand. The recipe exposes no range
    (its dataset draws 0..100 and its CLI builds the dataset itself), so the dataset's problem maker
    is swapped for this run only."""
    from functools import partial

    from tinker_cookbook.recipes.math_rl import arithmetic_env
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder

    if max_operand == RECIPE_MAX_OPERAND:
        yield
        return

    def make_group(self: arithmetic_env.ArithmeticDataset, rng) -> ProblemGroupBuilder:  # noqa: ANN001
        x, y = rng.randint(0, max_operand + 1), rng.randint(0, max_operand + 1)
        prefix = arithmetic_env.ArithmeticEnv.standard_fewshot_prefix() if self.include_fewshot else None
        env = partial(arithmetic_env.ArithmeticEnv, x, y, convo_prefix=prefix, renderer=self.renderer)
        return ProblemGroupBuilder(env_thunk=env, num_envs=self.group_size)

    original = arithmetic_env.ArithmeticDataset._make_env_group_builder
    arithmetic_env.ArithmeticDataset._make_env_group_builder = make_group  # type: ignore[method-assign]
    try:
        yield
    finally:
        arithmetic_env.ArithmeticDataset._make_env_group_builder = original  # type: ignore[method-assign]


if __name__ == "__main__":
    run(sys.argv[1:])
