"""GRPO on arithmetic: the cookbook's `math_rl` recipe with its arithmetic environment (problems
generated in code, so no dataset download): groups of samples per problem, reward 1 for the right
sum, advantages centred within each group. The default loss is the cookbook's, `stable_reinforce`,
which samples with `record_stability_info`; `--loss-fn importance_sampling` needs neither."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from examples.common import parser, renderer_for, write_curve


def run(argv: list[str] | None = None) -> Path:
    p = parser("grpo", steps=30, lr=4e-4)
    p.add_argument("--problems", type=int, default=8, help="Problems per step (groups per batch).")
    p.add_argument("--group-size", type=int, default=4, help="Samples per problem.")
    p.add_argument("--max-tokens", type=int, default=8, help="Longest answer sampled.")
    p.add_argument("--loss-fn", default=None, help="RL loss (default: the recipe's, stable_reinforce).")
    args = p.parse_args(argv)
    from tinker_cookbook.recipes.math_rl import train as math_rl

    extra = {"loss_fn": args.loss_fn} if args.loss_fn else {}
    config = math_rl.CLIConfig(
        log_path=str(args.out), model_name=args.model, renderer_name=renderer_for(args.model, args.renderer),
        env="arithmetic", group_size=args.group_size, groups_per_batch=args.problems, learning_rate=args.lr,
        lora_rank=args.rank, max_tokens=args.max_tokens, max_steps=args.steps, base_url=args.base_url,
        eval_every=0, save_every=0, behavior_if_log_dir_exists="delete", **extra,
    )
    asyncio.run(math_rl.cli_main(config))
    csv_path, png = write_curve(args.out, "env/all/reward/total", f"GRPO on arithmetic, {args.model}",
                                extra=("env/all/correct", "env/all/format"))
    print(f"metrics: {csv_path}\ncurve: {png}")
    return args.out


if __name__ == "__main__":
    run(sys.argv[1:])
