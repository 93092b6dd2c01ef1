"""Training operations: create/load a model, forward(-backward), optimizer steps, loads; the saves
are saves.py's (reached through `TrainingService` all the same).

Each operation on an existing model goes through the model's Sequencer (seq_id order). A request
refused before it is queued still gives up its seq_id, so the client's later requests do not wait
for it forever.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tinker import types

from mint_server.api.auth.keys import Principal
from mint_server.api.catalog.policies import policy_name
from mint_server.api.core import Core
from mint_server.api.http.statuses import status_for
from mint_server.api.state.clients import CustomLoss, TrainingModel
from mint_server.api.state.runs import RunRecord
from mint_server.api.state.sessions import Session
from mint_server.api.state.usage import TRAINING
from mint_server.api.tinker import revision_state
from mint_server.api.tinker.codec import FwdBwdCall, describe_validation_error
from mint_server.api.tinker.ordering import SeqError, Sequencer
from mint_server.api.tinker.saves import Op, Saves, lora_shape
from mint_server.api.tinker.validate import InvalidInput, check_lora
from mint_server.api.work import waits_on_engine
from mint_server.engine.interface import AdapterLost, EngineError, compile_loss

log = logging.getLogger(__name__)
MAX_CUSTOM_LOSSES = 64  # per session


def check_optimizer(config: Any) -> str:
    """The optimizer family an optimizer_config selects: "adamw" or "dimuon"."""
    if config is None or isinstance(config, types.AdamOptimizerConfig):
        return "adamw"
    data = config.model_dump()
    if data.get("type") == "dimuon":
        try:
            types.DimuonOptimizerConfig.model_validate(data)
        except ValidationError as e:
            raise InvalidInput(describe_validation_error(e, prefix="optimizer_config")) from None
        return "dimuon"
    raise InvalidInput(f"optimizer_config.type {data.get('type')!r} is not supported; 'adamw' or 'dimuon'")


def optimizer_config(family: str) -> types.OptimizerConfig:
    return types.DimuonOptimizerConfig() if family == "dimuon" else types.AdamOptimizerConfig()


def _known(e: BaseException) -> bool:
    """Whether the HTTP layer maps `e` to a status of its own (else it would be an internal error)."""
    return isinstance(e, EngineError) or status_for(e) != 500


def _unprepared(op: str, e: BaseException) -> InvalidInput:
    """The last resort for an exception no rule names, raised while a request was checked and
    prepared (its input parsed for the engine, before it was queued): a 400 that says what failed
    and carries an id that finds the traceback in the server log, never a bare 500."""
    error_id = uuid.uuid4().hex[:16]
    log.error("%s: preparing the request failed (error id %s)", op, error_id, exc_info=e)
    return InvalidInput(f"{op}: the request could not be prepared for the engine ({type(e).__name__}: {e}); "
                        f"error id {error_id}")


class TrainingService:
    def __init__(self, core: Core, on_sampler_snapshot: Callable[[TrainingModel, str, Path | None], None]) -> None:
        self.admission = core.admission
        self.stores = core.stores
        self.policies = core.policies
        self.sources = core.sources
        self.work = core.work
        self.engine = core.work.engine
        # The save operations live apart (saves.py); the routes and extensions reach them here.
        self.saves = Saves(core, self.sequenced, on_sampler_snapshot)
        self.save_weights = self.saves.save_weights
        self.save_weights_for_sampler = self.saves.save_weights_for_sampler
        self.save_weights_external = self.saves.save_weights_external
        self.save_checkpoint = self.saves.save_checkpoint

    # --- creation -----------------------------------------------------------------------------------
    def create_model(self, p: Principal, req: types.CreateModelRequest) -> types.UntypedAPIFuture:
        session = self.stores.sessions.live(req.session_id, p.owner)
        self.sources.check_base_model(req.base_model)
        if req.lora_config is None:
            raise InvalidInput("lora_config is required: this server trains LoRA adapters only")
        check_lora(req.lora_config, self.engine.limits)
        family = check_optimizer(req.optimizer_config)
        lora = req.lora_config

        async def make_adapter() -> str:
            return await self.work.call(self.engine.create_adapter(lora, family))

        return self._start_model(
            p, session, req.model_seq_id, lora, make_adapter, req.user_metadata,
            lambda model_id: types.CreateModelResponse(model_id=model_id), "create_model", optimizer=family,
        )

    def create_from_state(self, p: Principal, req: types.LoadWeightsRequest) -> types.UntypedAPIFuture:
        """load_weights addressed by session_id + model_seq_id: a new model starting from a checkpoint."""
        if req.model_seq_id is None:
            raise InvalidInput("model_seq_id is required with session_id")
        session = self.stores.sessions.live(req.session_id or "", p.owner)
        if (st := self._revision(req.path, p.owner, req.optimizer)) is not None:
            return self._create_from_revision(p, session, req, st)
        rec, run = self.sources.resolve(req.path, p.owner)
        if rec.kind != "weights":
            raise InvalidInput(f"path {req.path!r}: a training client loads tinker://…/weights/… checkpoints")
        self.sources.check_base_model(req.base_model)
        saved_family = run.optimizer.get("type", "adamw")
        if req.optimizer:  # a full-state resume keeps the optimizer the state was trained with
            family = saved_family
            if req.optimizer_config is not None and check_optimizer(req.optimizer_config) != family:
                raise InvalidInput(f"optimizer_config: the checkpoint holds {family!r} optimizer state; resume it "
                                   f"with the same optimizer, or load weights only")
        else:
            family = check_optimizer(req.optimizer_config)
        lora = types.LoraConfig(**run.lora)
        state_dir, optimizer = self.stores.runs.data_dir(rec.ref), req.optimizer

        async def make_adapter() -> str:
            return await self.work.call(self.engine.load_state(None, state_dir, optimizer, family))

        return self._start_model(
            p, session, req.model_seq_id, lora, make_adapter, req.user_metadata,
            lambda model_id: types.LoadWeightsResponse(path=rec.ref.tinker_path, model_id=model_id), "load_weights",
            saved=(state_dir, optimizer, 0), optimizer=family,
        )

    def _revision(self, path: str, owner: str, with_optimizer: bool) -> revision_state.RevisionState | None:
        """The catalog revision a policy reference names, as a training start (None: a checkpoint path)."""
        return revision_state.resolve(self.policies, self.stores.ephemeral_root, path, owner, with_optimizer)

    def _create_from_revision(self, p: Principal, session: Session, req: types.LoadWeightsRequest,
                              st: revision_state.RevisionState) -> types.UntypedAPIFuture:
        """A new model starting from a catalog revision's weights (tinker://NAME@N), with a fresh
        optimizer: the revision becomes a weights-only training state the engine loads."""
        self.sources.check_base_model(req.base_model)  # an override must still name the served model
        family = check_optimizer(req.optimizer_config)
        assert req.model_seq_id is not None  # create_from_state checked it

        async def make_adapter() -> str:
            await revision_state.ensure_state(self.work, self.policies, st)
            return await self.work.call(self.engine.load_state(None, st.state_dir, False, family))

        return self._start_model(
            p, session, req.model_seq_id, st.lora, make_adapter, req.user_metadata,
            lambda model_id: types.LoadWeightsResponse(path=st.path, model_id=model_id), "load_weights",
            saved=(st.state_dir, False, 0), optimizer=family,
        )

    def _start_model(
        self,
        p: Principal,
        session: Session,
        model_seq_id: int,
        lora: types.LoraConfig,
        make_adapter: Callable[[], Awaitable[str]],
        user_metadata: dict[str, Any] | None,
        respond: Callable[[str], Any],
        op: str,
        saved: tuple[Path, bool, int] | None = None,
        optimizer: str = "adamw",
    ) -> types.UntypedAPIFuture:
        model_id = f"{session.session_id}:train:{model_seq_id}"
        if model_seq_id < 0:
            raise InvalidInput("model_seq_id must be >= 0")
        if (hit := self.stores.seen(model_id, 0)) is not None:
            return hit
        if model_id in self.stores.models or self.stores.runs.find_run(model_id) is not None:
            raise InvalidInput(f"model_seq_id {model_seq_id} was already used in this session")
        with self.admission.enter(p.owner) as ticket:  # before the model is registered: a 429 leaves none
            policy = policy_name(model_id, user_metadata)
            model = TrainingModel(model_id, p.owner, session.session_id, lora, Sequencer(next_seq=1), policy,
                                  saved=saved, optimizer=optimizer)
            self.stores.models[model_id] = model
            session.model_ids.append(model_id)

            async def create() -> Any:
                try:
                    model.adapter_id = await make_adapter()
                    now = time.time()
                    self.stores.runs.create_run(
                        RunRecord(
                            run_id=model_id, owner=p.owner, base_model=self.engine.base_model, lora=lora.model_dump(),
                            optimizer={"type": optimizer}, session_id=session.session_id, created_at=now,
                            last_request_time=now, user_metadata=user_metadata, project_id=session.project_id,
                        )
                    )
                except BaseException as e:
                    # A failed creation leaves nothing behind: no listed model without a run, no adapter.
                    model.failed = f"creation failed: {e}"
                    self.stores.models.pop(model_id, None)
                    if model_id in session.model_ids:
                        session.model_ids.remove(model_id)
                    if model.adapter_id is not None:
                        adapter_id, model.adapter_id = model.adapter_id, None
                        await self.work.call(self.engine.release_adapter(adapter_id))
                    raise
                return respond(model_id)

            future = model.sequencer.submit(None, create)
            return self.work.register(ticket, op, future, scope=model_id, seq_id=0)

    def get_info(self, p: Principal, req: types.GetInfoRequest) -> types.GetInfoResponse:
        model = self.stores.model(req.model_id, p.owner)
        return types.GetInfoResponse(
            model_id=model.model_id,
            model_data=types.ModelData(
                arch=self.engine.arch,
                model_name=self.engine.base_model,
                # A local dir loads offline with AutoTokenizer.from_pretrained; a hub name would not.
                tokenizer_id=str(self.engine.model_dir),
            ),
            is_lora=True,
            lora_rank=model.lora.rank,
            model_name=self.engine.base_model,
            optimizer_config=optimizer_config(model.optimizer),
        )

    # --- ordered operations -------------------------------------------------------------------------
    def give_up_seq(self, p: Principal, model_id: str, seq_id: int, error: BaseException | None = None) -> None:
        """A request for `model_id` with this seq_id was refused before it could be queued (its body
        could not be decoded): later requests must not wait for it, and a resubmission of it gets
        the same error (`error`, else the one being handled). Unknown models, other owners' models
        and seq_ids that could never run are ignored: the refusal already answers them."""
        model = self.stores.models.get(model_id)
        if model is None or model.owner != p.owner:
            return
        try:
            model.sequencer.check(seq_id)
        except SeqError:
            return
        error = error if error is not None else sys.exc_info()[1]
        if error is None:
            model.sequencer.skip(seq_id)
        else:
            model.sequencer.refuse(seq_id, error)

    def sequenced(
        self, p: Principal, model_id: str, seq_id: int | None, op: str, check: Callable[[TrainingModel], Op]
    ) -> types.UntypedAPIFuture:
        """Validate with `check` (which returns the operation) and queue it in seq_id order."""
        model = self.stores.model(model_id, p.owner)
        if (hit := self.stores.seen(model_id, seq_id)) is not None:
            return hit
        if seq_id is not None and (earlier := model.sequencer.refusal(seq_id)) is not None:
            raise earlier.with_traceback(None)  # a resubmitted refused request: the real error again
        # A 429 keeps the seq_id: the SDK resubmits this same request.
        with self.admission.enter(p.owner) as ticket:
            if seq_id is not None:
                model.sequencer.check(seq_id)  # SeqError: a 400 naming seq_id
            try:
                run = check(model)
            except Exception as e:
                refused = e if _known(e) else _unprepared(op, e)
                if seq_id is not None:
                    model.sequencer.refuse(seq_id, refused)
                if refused is e:
                    raise
                raise refused from None

            engine_wait: list[Any] = [None]

            async def touched() -> Any:
                waits_on_engine(engine_wait)
                self.stores.runs.touch(model_id)
                if model.lost:
                    await self._resume(model)
                try:
                    return await run()
                except AdapterLost:
                    model.lost = True  # retryable: the client's next call resumes from the saved state
                    raise

            future = model.sequencer.submit(seq_id, touched)
            return self.work.register(ticket, op, future, scope=model_id, seq_id=seq_id, engine_wait=engine_wait)

    # --- server-side custom losses -------------------------------------------------------------------
    def create_custom_loss(self, p: Principal, req: types.CreateCustomLossRequest) -> types.UntypedAPIFuture:
        """Check and store a traced loss; it never runs here (see engine.custom_loss for the rules)."""
        session = self.stores.sessions.live(req.session_id, p.owner)
        loss_id = f"{session.session_id}:loss:{req.custom_loss_seq_id}"
        if (hit := self.stores.seen(loss_id, 0)) is not None:
            return hit
        if req.custom_loss_seq_id < 0:
            raise InvalidInput("custom_loss_seq_id must be >= 0")
        if loss_id in self.stores.custom_losses:
            raise InvalidInput(f"custom_loss_seq_id {req.custom_loss_seq_id} was already used in this session")
        if sum(c.session_id == session.session_id for c in self.stores.custom_losses.values()) >= MAX_CUSTOM_LOSSES:
            raise InvalidInput(f"a session may create at most {MAX_CUSTOM_LOSSES} custom losses")
        with self.admission.enter(p.owner) as ticket:
            compiled = compile_loss(req.name, [(i.name, i.rank) for i in req.inputs], req.graph.nodes)
            self.stores.custom_losses[loss_id] = CustomLoss(loss_id, p.owner, session.session_id, compiled)
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(types.CreateCustomLossResponse(loss_id=loss_id))
            return self.work.register(ticket, "create_custom_loss", done, scope=loss_id, seq_id=0)

    def _custom_loss(self, model: TrainingModel, call: FwdBwdCall) -> Op:
        config = call.loss_fn_config or {}
        loss_id = config.get("loss_id")
        if set(config) != {"loss_id"} or not isinstance(loss_id, str):
            raise InvalidInput("loss_fn_config: loss 'custom' takes exactly {'loss_id': <id from create_custom_loss>}")
        loss = self.stores.custom_losses.get(loss_id)
        if loss is None or loss.owner != model.owner or loss.session_id != model.session_id:
            raise InvalidInput(f"loss_fn_config.loss_id {loss_id!r} is unknown (custom losses belong to the "
                               "session that created them)")
        if call.forward_only:
            raise InvalidInput("loss_fn 'custom': a server-side custom loss runs in forward_backward, not forward")
        job = self.engine.prepare_custom(call.data, loss.compiled)  # parsed here: bad input is a 400
        return lambda: self.work.call(self.engine.submit(job.on(model.adapter())))

    def forward_backward(self, p: Principal, call: FwdBwdCall) -> types.UntypedAPIFuture:
        def check(model: TrainingModel) -> Op:
            if call.loss_fn == "custom":
                return self._recorded(model, call, self._custom_loss(model, call))
            if call.loss_fn == "stable_reinforce":  # the one loss that reads sampling records
                self.stores.recorded.check(call.data, model.owner, self.stores.samplers)
            # Parsed once, here, before the request takes its place in the sequence: bad input is a
            # 400 naming the field, and the engine runs the typed job without checking it again.
            job = self.engine.prepare_train(call.data, call.loss_fn, call.loss_fn_config, backward=not call.forward_only,
                                            key=model.owner)
            return self._recorded(model, call, lambda: self.work.call(self.engine.submit(job.on(model.adapter()))))

        return self.sequenced(p, call.model_id, call.seq_id, "forward" if call.forward_only else "forward_backward", check)

    def _recorded(self, model: TrainingModel, call: FwdBwdCall, op: Op) -> Op:
        """`op`, whose result is metered (tokens trained) and, for a backward pass, held for the
        run's next step record (run_metrics.py)."""
        async def run() -> Any:
            out = await op()
            tokens = sum(d.model_input.length for d in call.data)
            self.stores.meter.count(model.owner, TRAINING, tokens, session_id=model.session_id,
                                    project_id=self.stores.project_of(model.session_id))
            if not call.forward_only:
                self.stores.run_metrics.forward_backward(model.model_id, call.loss_fn, call.data, out)
            return out

        return run

    def optim_step(self, p: Principal, req: types.OptimStepRequest) -> types.UntypedAPIFuture:
        def check(model: TrainingModel) -> Op:
            job = self.engine.prepare_optim(req.optim_params, family=model.optimizer)

            async def run() -> types.OptimStepResponse:
                out = await self.work.call(self.engine.submit(job.on(model.adapter())))
                model.steps += 1
                self.stores.run_metrics.optim_step(model.model_id, model.steps, out)
                return out

            return run

        return self.sequenced(p, req.model_id, req.seq_id, "optim_step", check)

    def load_weights(self, p: Principal, req: types.LoadWeightsRequest) -> types.UntypedAPIFuture:
        if req.session_id is not None:
            return self.create_from_state(p, req)
        if req.model_id is None:
            raise InvalidInput("load_weights needs model_id (existing model) or session_id (new model)")

        def check(model: TrainingModel) -> Op:
            if (st := self._revision(req.path, p.owner, req.optimizer)) is not None:
                return self._load_revision(model, st)
            rec, run_rec = self.sources.resolve(req.path, p.owner)
            if rec.kind != "weights":
                raise InvalidInput(f"path {req.path!r}: load_weights takes tinker://…/weights/… checkpoints")
            if lora_shape(run_rec.lora) != lora_shape(model.lora):
                raise InvalidInput(
                    f"checkpoint LoRA config {lora_shape(run_rec.lora)} does not match this model's "
                    f"{lora_shape(model.lora)}"
                )
            saved_family = run_rec.optimizer.get("type", "adamw")
            if req.optimizer and saved_family != model.optimizer:
                raise InvalidInput(f"path {req.path!r} holds {saved_family!r} optimizer state; this model uses the "
                                   f"{model.optimizer!r} optimizer (load with optimizer=False for the weights only)")
            src = self.stores.runs.data_dir(rec.ref)

            async def run() -> types.LoadWeightsResponse:
                if not self.stores.runs.exists(rec.ref):
                    raise InvalidInput(f"checkpoint {req.path!r} was deleted")
                await self.work.call(self.engine.load_state(model.adapter(), src, req.optimizer))
                model.saved = (src, req.optimizer, model.steps)
                return types.LoadWeightsResponse(path=rec.ref.tinker_path, model_id=model.model_id)

            return run

        return self.sequenced(p, req.model_id, req.seq_id, "load_weights", check)

    def _load_revision(self, model: TrainingModel, st: revision_state.RevisionState) -> Op:
        """load_weights of a catalog revision into an existing model of the same LoRA config: its
        weights and a fresh optimizer (as load_state without the optimizer; a revision has none)."""
        if lora_shape(st.lora) != lora_shape(model.lora):
            raise InvalidInput(f"revision {st.path!r} LoRA config {lora_shape(st.lora)} does not match this "
                               f"model's {lora_shape(model.lora)}")

        async def run() -> types.LoadWeightsResponse:
            await revision_state.ensure_state(self.work, self.policies, st)
            await self.work.call(self.engine.load_state(model.adapter(), st.state_dir, False))
            model.saved = (st.state_dir, False, model.steps)
            return types.LoadWeightsResponse(path=st.path, model_id=model.model_id)

        return run

    def unload_model(self, p: Principal, req: types.UnloadModelRequest) -> types.UntypedAPIFuture:
        def check(model: TrainingModel) -> Op:
            async def run() -> types.UnloadModelResponse:
                await self._release(model, "model was unloaded")
                return types.UnloadModelResponse(model_id=model.model_id)

            return run

        return self.sequenced(p, req.model_id, None, "unload_model", check)

    # --- helpers ------------------------------------------------------------------------------------
    async def _resume(self, model: TrainingModel) -> None:
        """The model's adapter died with its engine replica: rebuild it from its last saved state
        (or, never saved, afresh from its LoraConfig) wherever the engine places it now."""
        if model.saved is None:
            new_id = await self.work.call(self.engine.create_adapter(model.lora, model.optimizer))
            steps = 0
        else:
            path, optimizer, steps = model.saved
            if not path.exists():
                raise InvalidInput(f"model {model.model_id!r} lost its live state and its last saved "
                                   f"state {path.name!r} was deleted; create a new model from a checkpoint")
            new_id = await self.work.call(self.engine.load_state(None, path, optimizer, model.optimizer))
        old, model.adapter_id, model.steps, model.lost = model.adapter_id, new_id, steps, False
        if old is not None:
            await self.work.call(self.engine.release_adapter(old))

    async def _release(self, model: TrainingModel, reason: str) -> None:
        """Free the model's adapter; its checkpoints and run record stay."""
        model.failed = reason
        self.stores.models.pop(model.model_id, None)
        self.stores.run_metrics.forget(model.model_id)
        if model.adapter_id is not None:
            adapter_id, model.adapter_id = model.adapter_id, None
            await self.work.call(self.engine.release_adapter(adapter_id))

    async def retire(self, model: TrainingModel, reason: str) -> None:
        """Session ended: drop queued work, let the running op finish, then free the adapter."""
        model.sequencer.close(reason)
        await model.sequencer.drained()
        await self._release(model, reason)
