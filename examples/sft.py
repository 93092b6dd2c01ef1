"""Supervised fine-tuning: the cookbook's `chat_sl` recipe on the chat conversations it ships
(tinker_cookbook/example_data/conversations.jsonl, so no dataset download), then the learning
curve of the training NLL."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from examples.common import parser, renderer_for, write_curve

CONVERSATIONS_PER_EPOCH = 128  # lines in the cookbook's example_data/conversations.jsonl


def conversations_file() -> str:
    import tinker_cookbook

    return str(Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl")


def run(argv: list[str] | None = None) -> Path:
    p = parser("sft", steps=32, lr=2e-4)
    p.add_argument("--batch-size", type=int, default=8, help="Conversations per step.")
    args = p.parse_args(argv)
    from tinker_cookbook.recipes.chat_sl import train as chat_sl

    epochs = math.ceil(args.steps / max(1, CONVERSATIONS_PER_EPOCH // args.batch_size))
    config = chat_sl.CLIConfig(
        log_path=str(args.out), model_name=args.model, renderer_name=renderer_for(args.model, args.renderer),
        dataset=conversations_file(), batch_size=args.batch_size, learning_rate=args.lr, lora_rank=args.rank,
        num_epochs=epochs, max_steps=args.steps, max_length=1024, base_url=args.base_url,
        save_every=0, eval_every=0, behavior_if_log_dir_exists="delete",
    )
    chat_sl.cli_main(config)
    csv_path, png = write_curve(args.out, "train_mean_nll", f"SFT (chat_sl) on {args.model}")
    print(f"metrics: {csv_path}\ncurve: {png}")
    return args.out


if __name__ == "__main__":
    run(sys.argv[1:])
