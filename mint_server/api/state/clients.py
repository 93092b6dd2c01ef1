"""The live objects behind the SDK's clients: training models, sampling sessions and the custom
losses a session uploaded. They live in `Stores` while their session does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from mint_server.api.state.futures import CompletionLog
from mint_server.api.tinker.ordering import Sequencer
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.records import Revision
from mint_server.engine.interface import AdapterSource


@dataclass
class TrainingModel:
    model_id: str
    owner: str
    session_id: str
    lora: types.LoraConfig
    sequencer: Sequencer
    policy: str  # where its save_weights_for_sampler calls publish revisions
    adapter_id: str | None = None
    failed: str | None = None
    steps: int = 0  # optim_steps applied so far: the `step` recorded on its revisions
    last_revision: Revision | None = None  # the parent of its next revision
    # What its adapter resumes from if its engine replica dies: (state dir, with optimizer, steps);
    # None: a fresh adapter from its LoraConfig (same seed, same start).
    saved: tuple[Path, bool, int] | None = None
    lost: bool = False  # its adapter died with its replica: the next op resumes from `saved` first
    optimizer: str = "adamw"  # its optimizer family ("adamw" | "dimuon"), fixed for its life

    def adapter(self) -> str:
        if self.failed is not None:
            raise InvalidInput(f"model {self.model_id!r} is unusable: {self.failed}")
        if self.adapter_id is None:  # cannot happen: creation is the first op in the sequence
            raise RuntimeError(f"model {self.model_id!r} has no adapter yet")
        return self.adapter_id


@dataclass
class SamplingSession:
    sampler_id: str
    owner: str
    session_id: str
    base_model: str
    model_path: str | None
    source: AdapterSource | str | None  # a read-only source, a training adapter id (inflight), None: the base
    ephemeral_dir: Path | None = None
    # kind="inflight": samples read this training model's own adapter slot, so every optimizer
    # step reaches them with no copy (the weights of the client's creation or newer).
    live: TrainingModel | None = None
    # retrieve_futures completion queues, by clone id (seq_id // 1e9; 0 for the original client)
    completions: dict[int, CompletionLog] = field(default_factory=dict)
    recorded: list[str] = field(default_factory=list)  # id prefixes of its recorded sequences
    pending: set[str] = field(default_factory=set)  # request ids of its unfinished samples


@dataclass(frozen=True)
class CustomLoss:
    loss_id: str
    owner: str
    session_id: str
    compiled: Any  # engine.custom_loss.CompiledLoss: checked, never executable code
