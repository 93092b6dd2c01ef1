"""State shared by the service's operations: registries, the engine handle and common helpers.

Everything here runs on the server's event loop, so plain dicts suffice; engine work happens in
the engine's own threads and comes back through `asyncio.wrap_future`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tinker import types

from mint_server.api.admission import Admission
from mint_server.api.catalog.policies import Policies, served_base_precision
from mint_server.api.http.metrics import Metrics
from mint_server.api.settings import Settings
from mint_server.api.state.futures import CompletionLog, FutureStore
from mint_server.api.state.pauses import PauseBoard
from mint_server.api.state.recorded import RecordedSequences
from mint_server.api.state.run_metrics import RunMetrics
from mint_server.api.state.runs import CheckpointRecord, NotFound, RunRecord, RunStore
from mint_server.api.state.sessions import SessionRegistry
from mint_server.api.state.usage import PREFILL, SAMPLE, Meter
from mint_server.api.tinker.ordering import Sequencer
from mint_server.api.tinker.paths import CheckpointRef, parse_checkpoint_path, parse_policy_ref
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.catalog import Catalog
from mint_server.catalog.ledger import Ledger
from mint_server.catalog.records import Revision
from mint_server.engine.interface import AdapterSource, Engine, EngineError, Priority, Prompt, SampleJob
from mint_server.model.config import ModelConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
# The engine future the current operation waits on, for queue-state answers (see Core.queue_position).
_ENGINE_WAIT: ContextVar[list[Future[Any] | None] | None] = ContextVar("mint_engine_wait", default=None)


def waits_on_engine(holder: list[Future[Any] | None]) -> None:
    """Called at the start of an operation's coroutine: its engine calls are noted in `holder`."""
    _ENGINE_WAIT.set(holder)


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


@dataclass(frozen=True)
class SamplingFace:
    """What differs between the faces' sample requests once they are parsed: the class their work
    runs at unless a request lowers it, where a request names its priority, and what the face calls
    each of the engine's request fields (`rename`: the engine's field path → the face's)."""

    default_priority: Priority
    priority_field: str
    rename: Callable[[str], str] = lambda field: field


# The Tinker face: rollout work; the priority comes in a header; the sampled top-k is topk_sample_logprobs.
TINKER_FACE = SamplingFace(Priority.ROLLOUT, "X-Mint-Priority header",
                           lambda field: "topk_sample_logprobs" if field == "top_logprobs" else field)


class Core:
    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics, catalog: Catalog) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.runs = RunStore(settings.data_dir / "runs")
        self.run_metrics = RunMetrics(self.runs)  # per-step training curves
        self.meter = Meter(Ledger(catalog.engine), engine.base_model)  # usage and audit, per tenant
        self.policies = Policies(catalog, engine.base_model, served_base_precision(engine))
        metrics.precision_mismatches.set_function(lambda: float(self.policies.precision_mismatches))
        self.futures = FutureStore(settings.result_ttl_s)
        self.sessions = SessionRegistry(settings.session_ttl_s)
        metrics.watch_engine(engine)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.custom_losses: dict[str, CustomLoss] = {}  # loss_id → uploaded loss (session-scoped)
        self.engine_waits: dict[str, list[Future[Any] | None]] = {}  # request id → its engine future
        self.pauses = PauseBoard()  # paused sampling targets (rollout control): new samples wait there
        self.recorded = RecordedSequences()  # which live session recorded which sequences
        # (model or sampler id, seq_id) → first answer: a resubmitted request gets it again.
        self.dedupe: dict[tuple[str, int], types.UntypedAPIFuture] = {}
        self.admission = Admission(settings)
        # Snapshots behind save_weights_and_get_sampling_client live only as long as their session.
        self.ephemeral_root = settings.data_dir / "ephemeral"
        shutil.rmtree(self.ephemeral_root, ignore_errors=True)
        self.ephemeral_root.mkdir(parents=True, exist_ok=True)
        self._tied: bool | None = None

    def tied_embeddings(self) -> bool:
        """Whether the base shares its embedding with the output layer (exports name that LoRA apart)."""
        if self._tied is None:
            self._tied = ModelConfig.from_hf_dir(self.engine.model_dir).tie_word_embeddings
        return self._tied

    def model(self, model_id: str, owner: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise NotFound(f"model_id {model_id!r} not found (unknown, unloaded, or not yours)")
        return model

    def seen(self, scope: str, seq_id: int | None) -> types.UntypedAPIFuture | None:
        return self.dedupe.get((scope, seq_id)) if seq_id is not None else None

    def register(
        self,
        owner: str,
        op: str,
        future: asyncio.Future[Any],
        *,
        scope: str | None = None,
        seq_id: int | None = None,
        sample_sequence_ids: list[str] | None = None,
        engine_wait: list[Future[Any] | None] | None = None,
    ) -> types.UntypedAPIFuture:
        """Track `future` under a new request id, with metrics, and answer the submit call.

        `engine_wait` is the holder the operation's coroutine passed to `waits_on_engine`."""
        request_id = self.futures.add(owner, op, future)
        self.admission.pending(owner)
        if engine_wait is not None:
            self.engine_waits[request_id] = engine_wait
        start = time.monotonic()
        queue = "sampling" if op == "sample" else "training"
        self.metrics.queue_depth.labels(queue).inc()

        def finished(f: asyncio.Future[Any]) -> None:
            self.admission.finished(owner)
            self.engine_waits.pop(request_id, None)
            self.metrics.queue_depth.labels(queue).dec()
            elapsed = time.monotonic() - start
            (self.metrics.sample_latency if op == "sample" else self.metrics.op_latency.labels(op)).observe(elapsed)
            error = None if f.cancelled() else f.exception()
            if f.cancelled() or error is not None:
                category = "user" if isinstance(error, EngineError) else "server"
                self.metrics.requests_failed.labels(op, category).inc()

        future.add_done_callback(finished)
        answer = types.UntypedAPIFuture(
            request_id=request_id,
            model_id=scope if scope and op != "sample" else None,
            sample_sequence_ids=sample_sequence_ids,
        )
        if scope is not None and seq_id is not None:
            self.dedupe[(scope, seq_id)] = answer
        return answer

    def spawn(self, coro: Any) -> asyncio.Future[Any]:
        """Run an operation that needs no ordering; the returned task is owned by the FutureStore."""
        return asyncio.ensure_future(coro)

    # --- engine -----------------------------------------------------------------------------------
    @staticmethod
    async def call(future: Future[T]) -> T:
        holder = _ENGINE_WAIT.get()
        if holder is not None:
            holder[0] = future
        return await asyncio.wrap_future(future)

    def engine_future(self, request_id: str) -> Future[Any] | None:
        holder = self.engine_waits.get(request_id)
        return holder[0] if holder else None

    def cancel_sample(self, request_id: str, owner: str) -> None:
        """Stop a pending sample of `owner`: dropped if still queued in the engine, else its rows
        end and free their KV (a finished one is left as is)."""
        engine_future = self.engine_future(request_id)  # before the cancel's callbacks forget it
        self.futures.cancel(request_id, owner)  # checks owner and kind
        if engine_future is not None:
            self.engine.cancel(engine_future)

    def queue_position(self, request_id: str) -> tuple[int, int] | None:
        """(position, depth) while the request's engine work waits behind others; None otherwise."""
        future = self.engine_future(request_id)
        if future is None or future.done():
            return None
        return self.engine.queue_position(future)

    # --- checkpoints ------------------------------------------------------------------------------
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

    def sample_job(self, owner: str, source: AdapterSource | str | None, prompt: types.ModelInput | Prompt | list[int],
                   num_samples: int, params: types.SamplingParams, prompt_logprobs: bool = False,
                   topk_prompt_logprobs: int = 0, record: bool = False, top_logprobs: int = 0,
                   priority: str | None = None, controls: dict[str, Any] | None = None,
                   face: SamplingFace | None = None) -> SampleJob:
        """The one door of every sample request, whichever face it came by: parsed by the engine's
        `prepare_sample` against its one set of rules (each bound checked there, once), fair admission
        keyed by owner, the priority lowered as the face allows. A refusal is an EngineError naming
        its field as `face` calls it. The prompt goes to the engine as it came: its parser reads
        image chunks (or refuses them by name). `controls`: prepare_sample's keyword controls
        (penalties, min_p, logit_bias, response_format, stop_at_eos, the prompt-scoring fields)."""
        face = face or TINKER_FACE
        try:
            klass = Priority.lowered(priority, face.default_priority, face.priority_field)
            return self.engine.prepare_sample(source, prompt, num_samples, params, prompt_logprobs,
                                              topk_prompt_logprobs, record=record, key=owner,
                                              top_logprobs=top_logprobs, priority=klass, **(controls or {}))
        except EngineError as e:
            if e.field is None or (name := face.rename(e.field)) == e.field:
                raise
            raise e.renamed(name) from None

    def project_of(self, session_id: str | None) -> str | None:
        session = self.sessions.find(session_id) if session_id is not None else None
        return session.project_id if session is not None else None

    def note_sampled(self, owner: str, job: Any, result: types.SampleResponse, session_id: str | None = None) -> None:
        """Meter a finished sample request: its prompt once, and every token it drew."""
        project = self.project_of(session_id)
        self.meter.count(owner, PREFILL, len(job.prompt), session_id=session_id, project_id=project)
        drawn = sum(len(s.tokens) for s in result.sequences)
        self.meter.count(owner, SAMPLE, drawn, session_id=session_id, project_id=project)

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
