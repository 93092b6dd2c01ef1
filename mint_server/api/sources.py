"""Sources: what a path or model name in a request reads. A checkpoint of a run (own or published),
a policy revision pinned when it is named, or the served base model under any of its names."""

from __future__ import annotations

from pathlib import Path

from mint_server.api.catalog.policies import Policies
from mint_server.api.state.runs import CheckpointRecord, NotFound, RunRecord, RunStore
from mint_server.api.tinker.paths import CheckpointRef, parse_checkpoint_path, parse_policy_ref
from mint_server.api.tinker.validate import InvalidInput
from mint_server.engine.interface import AdapterSource, Engine
from mint_server.model.config import ModelConfig


class Sources:
    def __init__(self, engine: Engine, runs: RunStore, policies: Policies) -> None:
        self.engine = engine
        self.runs = runs
        self.policies = policies
        self._tied: bool | None = None

    def tied_embeddings(self) -> bool:
        """Whether the base shares its embedding with the output layer (exports name that LoRA apart)."""
        if self._tied is None:
            self._tied = ModelConfig.from_hf_dir(self.engine.model_dir).tie_word_embeddings
        return self._tied

    def resolve(self, path: str, owner: str) -> tuple[CheckpointRecord, RunRecord]:
        """A checkpoint path `owner` may read (own or published), with its run."""
        rec = self.runs.get_checkpoint(parse_checkpoint_path(path), owner)
        if rec.kind == "external_weights":
            # Exports may be encrypted to someone else's key: they are only ever downloaded.
            raise InvalidInput(f"path {path!r}: external weights are for download (external_weights_urls); "
                               "sample or load from a weights or sampler_weights checkpoint")
        run = self.runs.find_run(rec.run_id)
        if run is None:
            raise NotFound(f"checkpoint {path!r} not found")
        return rec, run

    def read_source(self, path: str, owner: str) -> AdapterSource:
        """What a path read for sampling names: a checkpoint, or a policy revision pinned now."""
        if (ref := parse_policy_ref(path)) is None:
            return self.source_of(*self.resolve(path, owner))
        revision, policy = self.policies.resolve(ref, owner)
        self.policies.check_servable(ref, policy)
        # Read from the blob store and verified on the engine's loader threads when first needed.
        return AdapterSource.of_revision(revision.sha256, self.policies.reader(revision))

    def source_of(self, rec: CheckpointRecord, run: RunRecord) -> AdapterSource:
        data = self.runs.data_dir(rec.ref)
        key = f"ckpt:{rec.ref.tinker_path}:{rec.created_at}"  # created_at: an overwrite is a new source
        if rec.kind == "sampler_weights":
            return AdapterSource(key, peft_dir=data)
        return AdapterSource(key, state_dir=data)

    def forget_checkpoint(self, ref: CheckpointRef) -> None:
        self.engine.forget_source(f"ckpt:{ref.tinker_path}:")

    def check_base_model(self, name: str | None, field_name: str = "base_model") -> None:
        """Accept any name of the served base model: its hub id, its short name or its checkpoint dir.

        Recipes use one string both to load a tokenizer and to name the model here, and users reach
        for whichever of the three they saw, so all mean the same model (stored under the hub id)."""
        if name is not None and not same_base_model(name, self.engine.base_model, self.engine.model_dir):
            raise InvalidInput(f"unknown {field_name} {name!r}; this server serves {self.engine.base_model!r}")


def same_base_model(name: str, base_model: str, model_dir: Path) -> bool:
    if name in (base_model, base_model.rsplit("/", 1)[-1]):
        return True
    if not name.startswith(("/", ".", "~")):  # a hub-style name that is not ours, not a path
        return False
    try:
        return Path(name).expanduser().resolve() == Path(model_dir).resolve()
    except (OSError, RuntimeError):
        return False
