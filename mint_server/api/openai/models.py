"""Which model an OpenAI-face request names: the base, a policy (NAME, NAME@ALIAS|N|<sha prefix>) or a
tinker:// path, resolved once when the request is admitted, like a Tinker sampling session's path
(an alias that moves afterwards changes only later requests); and the /models listing."""

from __future__ import annotations

from typing import Any

from mint_server.api.core import Core
from mint_server.api.openai.errors import OpenAIError
from mint_server.api.openai.reply import ServedModel
from mint_server.api.sources import same_base_model
from mint_server.api.state.runs import NotFound
from mint_server.api.tinker.paths import PathError, is_checkpoint_path, parse_policy_ref
from mint_server.api.tinker.validate import InvalidInput
from mint_server.catalog.errors import CatalogError

OWNED_BY = "mint"


class ServedModels:
    def __init__(self, core: Core) -> None:
        self.policies = core.policies
        self.sources = core.sources
        self.engine = core.work.engine

    def list_models(self, owner: str, limit: int, after: str | None) -> dict[str, Any]:
        """The base model, then each servable policy as NAME (its latest revision) and NAME@ALIAS."""
        catalog = self.policies.catalog
        data = [] if after else [self._model(self.engine.base_model, 0)]
        try:
            page = catalog.list_policies(owner, cursor=after, limit=limit)
            for policy in page.items:
                if policy.base_model != self.engine.base_model:
                    continue
                created = int(policy.created_at.timestamp())
                data.append(self._model(policy.name, created))
                cursor = None
                while True:
                    aliases = catalog.list_aliases(owner, policy.name, cursor=cursor, limit=1000)
                    data.extend(self._model(f"{policy.name}@{a.name}", created) for a in aliases.items)
                    if (cursor := aliases.next_cursor) is None:
                        break
        except CatalogError as e:  # a malformed `after` cursor
            raise OpenAIError.from_error(e, 400, "after") from None
        return {"object": "list", "data": data, "has_more": page.next_cursor is not None,
                "next_cursor": page.next_cursor}  # fmt: skip

    def get_model(self, owner: str, model_id: str) -> dict[str, Any]:
        self.resolve(model_id, owner)
        return self._model(model_id, 0)

    @staticmethod
    def _model(model_id: str, created: int) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}

    def resolve(self, model: str, owner: str) -> ServedModel:
        """The base model's name, NAME, NAME@ALIAS|N|<sha prefix>, or a tinker:// path (a sampler
        checkpoint or a policy reference), pinned now."""
        if same_base_model(model, self.engine.base_model, self.engine.model_dir):  # as the Tinker face does
            return ServedModel(model, None, "base")
        try:
            ref = parse_policy_ref(model) if is_checkpoint_path(model) else model
            if ref is None:
                rec, run = self.sources.resolve(model, owner)
                if rec.kind != "sampler_weights":  # training state is for resuming, not for serving
                    raise OpenAIError(400, f"model {model!r} is a {rec.kind} checkpoint; this face serves "
                                           "sampler weights (tinker://RUN/sampler_weights/NAME) and policy revisions",
                                      "model")  # fmt: skip
                source = self.sources.source_of(rec, run)
                return ServedModel(model, source, source.key)
            revision, policy = self.policies.resolve(ref, owner)
            self.policies.check_servable(ref, policy)
        except NotFound as e:
            raise OpenAIError(404, f"model {model!r} not found: {e}", "model", "model_not_found") from None
        except (InvalidInput, PathError) as e:
            raise OpenAIError(400, f"model {model!r}: {e}", "model") from None
        # The Tinker face's own source for this revision, named by number so it stays the one resolved now.
        source = self.sources.read_source(f"tinker://{revision.policy}@{revision.number}", owner)
        return ServedModel(model, source, f"{revision.policy}@{revision.number}:{revision.sha256[:12]}",
                           policy=revision.policy)
