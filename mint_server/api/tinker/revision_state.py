"""A catalog revision as the start of a training run: `create_training_client_from_state` (and
`load_state`) on a policy reference, `tinker://NAME@N` — what `mint import DIR --policy NAME` prints
for an adapter trained elsewhere (PEFT, Unsloth, TRL).

A revision is weights only (a PEFT dir), so training continues from its weights with a fresh
optimizer: AdamW (or Dimuon) moments start at zero and the step count at 0, as after `load_state`
without the optimizer. `..._with_optimizer` on a revision is refused by name.

The revision is read the way sampling reads it (the engine's loader checks every shape against the
base and refuses what it cannot compute exactly), and turned once into a weights-only training-state
dir under the ephemeral root, keyed by its content (sha256): the engine's own `load_state` then
starts the new model from it, and a model whose replica dies resumes from it like from any state.

Used by api/tinker/training.py (`create_from_state`, `load_weights`): `resolve(policies, states_root,
path, owner)` returns None for a checkpoint path, else the revision's LoRA config and state dir;
`await ensure_state(work, policies, state)` before the engine's `load_state(None | adapter,
state.state_dir, False, …)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker import types

from mint_server.api.tinker.paths import parse_policy_ref
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.records import Revision
from mint_server.engine.interface import AdapterSource

if TYPE_CHECKING:
    from mint_server.api.catalog.policies import Policies
    from mint_server.api.work import Work

# PEFT module names by the LoraConfig switch that trains them (strings only: no model code here).
_UNEMBED = frozenset({"lm_head", "unembed_tokens"})
_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})
STATES_DIR = "revision-states"


@dataclass(frozen=True)
class RevisionState:
    path: str  # tinker://NAME@N: the revision pinned by number, whatever alias named it
    revision: Revision
    base_model: str
    lora: types.LoraConfig
    state_dir: Path


def lora_of(rank: int, lora_config: dict[str, Any]) -> types.LoraConfig:
    """The tinker LoraConfig a revision trains as: its rank, and the switches its targets imply
    (the policy's own switches when it records them, as runs of this server do)."""
    modules = set(lora_config.get("target_modules") or ())
    flags = {
        "train_unembed": lora_config.get("train_unembed", bool(modules & _UNEMBED)),
        "train_mlp": lora_config.get("train_mlp", bool(modules & _MLP)),
        "train_attn": lora_config.get("train_attn", bool(modules - _UNEMBED - _MLP)),
    }
    return types.LoraConfig(rank=rank, **{k: bool(v) for k, v in flags.items()})


def resolve(policies: Policies, states_root: Path, path: str, owner: str,
            with_optimizer: bool = False) -> RevisionState | None:
    """None for a checkpoint path; for a policy reference, the revision it names now (own, servable
    on this base) as a training start, its state kept under `states_root`. InvalidInput for
    `with_optimizer` (a revision has none)."""
    ref = parse_policy_ref(path)
    if ref is None:
        return None
    revision, policy = policies.resolve(ref, owner)
    policies.check_servable(ref, policy)
    if with_optimizer:
        raise InvalidInput(f"path {path!r}: a policy revision holds adapter weights only, no optimizer state; "
                           "load it without the optimizer (create_training_client_from_state / load_state), "
                           "which starts the optimizer fresh")
    return RevisionState(
        path=f"tinker://{revision.ref}", revision=revision, base_model=policy.base_model,
        lora=lora_of(revision.rank, policy.lora_config), state_dir=states_root / STATES_DIR / revision.sha256,
    )


async def ensure_state(work: Work, policies: Policies, state: RevisionState) -> Path:
    """The revision's weights-only training-state dir, written once (atomically) by the engine: the
    revision loaded as sampling loads it, copied unchanged (one source, coefficient 1), saved."""
    if (state.state_dir / "state.json").is_file():
        return state.state_dir
    source = AdapterSource.of_revision(state.revision.sha256, policies.reader(state.revision))
    adapter = await work.call(work.engine.interpolate([source], [1.0]))
    try:
        await work.call(work.engine.save_state(adapter, state.state_dir, False))
    finally:
        await work.call(work.engine.release_adapter(adapter))
    return state.state_dir
