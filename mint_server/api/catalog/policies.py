"""The service's side of the policy catalog (MLflow-registry style, for LoRA policies).

* Every `save_weights_for_sampler` with a path publishes the saved PEFT dir as the next revision of
  its run's policy: the one named by `user_metadata["policy"]` at model creation, else one named
  after the run.
* A policy reference given where a checkpoint is read for sampling (`tinker://NAME@prod`,
  `tinker://NAME@3`, `tinker://NAME@<sha prefix>`) resolves to one revision when it is given, so a
  sampling session keeps its revision however the alias moves afterwards.
* A revision records the precision of the base it was trained on (`base_precision`: "fp32", "bf16",
  "int8", "fp8-dequantized-bf16" …); resolving one on a server whose base runs in another precision
  logs a warning, once per revision, and counts it (`Policies.precision_mismatches`): the adapter
  was fitted to other base weights, so what it computes here may differ from what it did in training.

Catalog calls block (SQL; blob copies with fsync). Publishing runs in a thread, revision reads on
the engine's loader threads;
resolving is a couple of indexed reads and runs inline, like the run registry's lookups. Catalog
errors become the service's own here: NotFound → 404, bad names and references → 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.catalog import Catalog
from mint_server.catalog.errors import IntegrityError, InvalidArgument
from mint_server.catalog.errors import NotFound as CatalogNotFound
from mint_server.catalog.records import Policy, Revision
from mint_server.catalog.refs import check_policy_name
from mint_server.engine.interface import Engine
from mint_server.model.config import ModelConfig
from mint_server.model.prequant_spec import base_precision

log = logging.getLogger(__name__)

POLICY_KEY = "policy"  # the user_metadata key naming the policy a run publishes to


class IntegrityFailure(Exception):
    """A revision's stored bytes do not hash to its sha256. It is refused, never loaded; the
    request fails with category "server" (the data is at fault, not the caller)."""


def policy_name(run_id: str, user_metadata: dict[str, Any] | None) -> str:
    """The policy a run publishes to; a bad name is refused when the model is created, not at its first save."""
    name = (user_metadata or {}).get(POLICY_KEY)
    if name is None:
        # Run ids are "<session hex>:train:<n>"; ':' is not allowed in policy names.
        return run_id.replace(":", "-")
    if not isinstance(name, str):
        raise InvalidInput(f"user_metadata[{POLICY_KEY!r}] must be a string (a policy name)")
    try:
        return check_policy_name(name, f"user_metadata[{POLICY_KEY!r}]")
    except InvalidArgument as e:
        raise InvalidInput.from_error(e) from None


def served_base_precision(engine: Engine) -> str | None:
    """The precision this engine's base runs in (prequant_spec.base_precision); None where the engine
    does not hold one dtype (a fleet's replicas choose their own)."""
    dtype = getattr(engine, "dtype", None)
    if dtype is None:
        return None
    prequantized = ModelConfig.from_hf_dir(engine.model_dir).prequantized
    return base_precision(dtype, engine.settings.quantize, prequantized)


class Policies:
    def __init__(self, catalog: Catalog, base_model: str, base_precision: str | None = None) -> None:
        self.catalog = catalog
        self.base_model = base_model
        self.base_precision = base_precision  # recorded on every revision published here
        self.precision_mismatches = 0  # revisions resolved here that were trained on another precision
        self._warned: set[int] = set()  # their ids: each is warned about once

    async def publish(
        self,
        owner: str,
        policy: str,
        peft_dir: Path,
        *,
        lora_config: dict[str, Any],
        parent: Revision | None,
        training_run: str,
        step: int,
    ) -> Revision:
        """Store `peft_dir` as the policy's next revision (the policy is created on first use)."""
        try:
            return await asyncio.to_thread(
                self.catalog.publish_revision,
                owner,
                policy,
                peft_dir,
                base_model=self.base_model,
                lora_config=lora_config,
                parent=parent,
                training_run=training_run,
                step=step,
                base_precision=self.base_precision,
            )
        except InvalidArgument as e:  # e.g. a policy of that name exists for another base model
            raise InvalidInput(f"cannot publish to policy {policy!r}: {e}") from None

    def resolve(self, ref: str, owner: str) -> tuple[Revision, Policy]:
        """The revision `ref` (NAME@…) names now, and its policy; another owner's look absent."""
        try:
            revision = self.catalog.resolve(owner, ref)
            self.check_precision(revision)
            return revision, self.catalog.get_policy(owner, revision.policy)
        except CatalogNotFound as e:
            raise NotFound(e.message, field=e.field) from None
        except InvalidArgument as e:
            raise InvalidInput.from_error(e) from None

    def check_precision(self, revision: Revision) -> None:
        """Warn, once per revision, when it was trained on a base of another precision than ours."""
        trained, served = revision.base_precision, self.base_precision
        if trained is None or served is None or trained == served or revision.id in self._warned:
            return
        self._warned.add(revision.id)
        self.precision_mismatches += 1
        log.warning("revision %s was trained on a %s base; this server's base runs in %s: its outputs may "
                    "differ from what it computed in training", revision.ref, trained, served)

    def check_servable(self, ref: str, policy: Policy) -> None:
        if policy.base_model != self.base_model:
            raise InvalidInput(
                f"{ref!r}: policy {policy.name!r} is for base model {policy.base_model!r}; "
                f"this server serves {self.base_model!r}"
            )

    def reader(self, revision: Revision) -> Callable[[], dict[str, bytes]]:
        """What the engine's loader calls (on its own thread) for the revision's verified files."""

        def read() -> dict[str, bytes]:
            try:
                return self.catalog.read_payload(revision)
            except IntegrityError as e:
                raise IntegrityFailure(
                    f"revision {revision.ref} (sha256:{revision.sha256[:12]}) failed its integrity check "
                    f"and was not loaded: {e}"
                ) from None

        return read
