"""On-policy distillation: the cookbook's `train_on_policy` — the student samples, the teacher
scores the student's tokens, and the student is trained on the per-token reverse KL. Prompts are
made in code (no dataset download). The teacher is a checkpoint (default: the final sampler
weights of `python -m examples.sft`, if that ran; else the base model itself, which gives a flat
KL curve); the student is a fresh LoRA on the base."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import chz
from tinker_cookbook.rl.types import RLDatasetBuilder

from examples.common import parser, renderer_for, write_curve


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    topics = ["the sea", "a cat", "the moon", "bread", "a train", "rain", "a garden", "music"]
    forms = ["Write one sentence about {}.", "Describe {} in a few words.", "What do you like about {}?"]
    return [rng.choice(forms).format(rng.choice(topics)) for _ in range(n)]


@chz.chz
class LocalPrompts(RLDatasetBuilder):
    n_prompts: int
    groups_per_batch: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):  # -> tuple[PromptOnlyDataset, None]
        from tinker_cookbook import renderers
        from tinker_cookbook.distillation.datasets import PromptOnlyDataset
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        train = PromptOnlyDataset(
            prompts=prompts(self.n_prompts), batch_size=self.groups_per_batch, group_size=self.group_size,
            renderer=renderer, tokenizer=tokenizer, dataset_name="local_prompts",
        )
        return train, None


def sft_teacher(sft_dir: Path) -> str | None:
    """The final sampler checkpoint the SFT example's run recorded, if any."""
    try:
        lines = (sft_dir / "checkpoints.jsonl").read_text().splitlines()
    except OSError:
        return None
    paths = [json.loads(x).get("sampler_path") for x in lines if x.strip()]
    return next((p for p in reversed(paths) if p), None)


def run(argv: list[str] | None = None) -> Path:
    p = parser("distill", steps=20, lr=2e-4)
    p.add_argument("--prompts", type=int, default=4, help="Prompts per step.")
    p.add_argument("--group-size", type=int, default=2, help="Student samples per prompt.")
    p.add_argument("--max-tokens", type=int, default=32, help="Longest student sample.")
    p.add_argument("--teacher-checkpoint", default=None,
                   help="tinker:// sampler checkpoint of the teacher (default: the SFT example's final one).")
    args = p.parse_args(argv)
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

    renderer = renderer_for(args.model, args.renderer)
    teacher = args.teacher_checkpoint or sft_teacher(Path("runs") / "sft")
    dataset = DistillationDatasetConfig(
        dataset_builder=LocalPrompts(
            n_prompts=args.prompts * args.steps, groups_per_batch=args.prompts, group_size=args.group_size,
            model_name_for_tokenizer=args.model, renderer_name=renderer,
        ),
        teacher_config=TeacherConfig(base_model=args.model, load_checkpoint_path=teacher),
        groups_per_batch=args.prompts,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    config = train_on_policy.Config(
        recipe_name="examples_distill", learning_rate=args.lr, dataset_configs=[dataset], model_name=args.model,
        renderer_name=renderer, lora_rank=args.rank, max_tokens=args.max_tokens, log_path=str(args.out),
        base_url=args.base_url, eval_every=0, save_every=0, max_steps=args.steps,
    )
    asyncio.run(train_on_policy.main(config))
    csv_path, png = write_curve(args.out, "teacher_kl", f"On-policy distillation on {args.model}")
    print(f"teacher: {teacher or args.model + ' (base)'}\nmetrics: {csv_path}\ncurve: {png}")
    return args.out


if __name__ == "__main__":
    run(sys.argv[1:])
