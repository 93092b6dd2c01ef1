"""Run a tinker-cookbook recipe module on a model its model table does not list.

    python -m examples.run_recipe tinker_cookbook.recipes.sl_loop model_name=HuggingFaceTB/SmolLM2-135M-Instruct …

Recipes with a `renderer_name` option take `renderer_name=qwen3_instruct` directly; `sl_loop` and
`rl_loop` have none and ask the cookbook's model table, which refuses unknown models. This adds one
entry to that table — SmolLM2 (any `HuggingFaceTB/…` id, or a local checkpoint dir) renders as
ChatML without thinking, i.e. `qwen3_instruct` — and runs the module as `python -m` would.
"""

from __future__ import annotations

import os
import runpy
import sys

from examples.common import CHATML_RENDERER


def register_chatml_models() -> None:
    from tinker_cookbook import model_info

    known = model_info.get_model_attributes

    def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
        name = model_name.split(":", 1)[0]
        if name.startswith("HuggingFaceTB/") or os.path.isdir(name):
            return model_info.ModelAttributes(
                organization="HuggingFaceTB", version_str="2", size_str="unknown",
                is_chat=True, recommended_renderers=(CHATML_RENDERER,),
            )
        return known(model_name)

    model_info.get_model_attributes = get_model_attributes


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    module = sys.argv[1]
    register_chatml_models()
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
