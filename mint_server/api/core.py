"""What every face shares: the composition root `Core`, and the one door of every sample request
(`sample_job`, with the `SamplingFace` that says how a face names the engine's fields).

`Core` builds each concern once; an operation group takes the parts it uses:
  admission   `api/admission.py`: whether work is taken (one call, `Admission.enter`)
  stores      `api/state/stores.py`: runs, sessions, futures, models, samplers, usage, pauses, records
  policies    `api/catalog/policies.py`: the catalog's policies and revisions
  sources     `api/sources.py`: what a checkpoint path, policy reference or base model name reads
  work        `api/work.py`: the engine handle; registered futures, engine waits, queue positions
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinker import types

from mint_server.api.admission import Admission
from mint_server.api.catalog.policies import Policies, served_base_precision
from mint_server.api.http.metrics import Metrics
from mint_server.api.settings import Settings
from mint_server.api.sources import Sources
from mint_server.api.state.stores import Stores
from mint_server.api.work import Work
from mint_server.catalog.catalog import Catalog
from mint_server.catalog.ledger import Ledger
from mint_server.engine.interface import AdapterSource, Engine, EngineError, Priority, Prompt, SampleJob


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


def sample_job(engine: Engine, owner: str, source: AdapterSource | str | None,
               prompt: types.ModelInput | Prompt | list[int], num_samples: int, params: types.SamplingParams,
               prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, record: bool = False,
               top_logprobs: int = 0, priority: str | None = None, controls: dict[str, Any] | None = None,
               face: SamplingFace = TINKER_FACE) -> SampleJob:  # fmt: skip
    """The one door of every sample request, whichever face it came by: parsed by the engine's
    `prepare_sample` against its one set of rules (each bound checked there, once), fair admission
    keyed by owner, the priority lowered as the face allows. A refusal is an EngineError naming
    its field as `face` calls it. The prompt goes to the engine as it came: its parser reads
    image chunks (or refuses them by name). `controls`: prepare_sample's keyword controls
    (penalties, min_p, logit_bias, response_format, stop_at_eos, the prompt-scoring fields)."""
    try:
        klass = Priority.lowered(priority, face.default_priority, face.priority_field)
        return engine.prepare_sample(source, prompt, num_samples, params, prompt_logprobs, topk_prompt_logprobs,
                                     record=record, key=owner, top_logprobs=top_logprobs, priority=klass,
                                     **(controls or {}))  # fmt: skip
    except EngineError as e:
        if e.field is None or (name := face.rename(e.field)) == e.field:
            raise
        raise e.renamed(name) from None


class Core:
    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics, catalog: Catalog) -> None:
        self.settings = settings
        self.metrics = metrics
        self.admission = Admission(settings)
        self.stores = Stores(settings, Ledger(catalog.engine), engine.base_model)
        self.policies = Policies(catalog, engine.base_model, served_base_precision(engine))
        self.sources = Sources(engine, self.stores.runs, self.policies)
        self.work = Work(engine, self.stores.futures, self.stores.dedupe, metrics)
        metrics.precision_mismatches.set_function(lambda: float(self.policies.precision_mismatches))
        metrics.watch_engine(engine)
