"""One owner-scoped interface over either a local Catalog or a running MinT server's REST routes.

The CLI talks to a `CatalogClient` and does not care which it has. `HttpClient` rebuilds the same
record dataclasses and raises the same exception classes as the local catalog.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import quote

from mint_server.api import CATALOG_PREFIX as API_PREFIX
from mint_server.api import KEYS_PREFIX
from mint_server.catalog import archive, gc, payload
from mint_server.catalog import seed as seeding
from mint_server.catalog.catalog import Catalog
from mint_server.catalog.errors import (
    AlreadyExists,
    CatalogError,
    IntegrityError,
    InvalidArgument,
    InvalidReference,
    NotFound,
)
from mint_server.catalog.keys import KeyStore
from mint_server.catalog.records import (
    Alias,
    AliasEvent,
    ApiKey,
    EvalRecord,
    GcReport,
    Page,
    Policy,
    Revision,
    SeedResult,
    from_dict,
)

if TYPE_CHECKING:
    import httpx  # imported where used: local-mode CLI commands need not pay for it

T = TypeVar("T")


class CatalogClient(Protocol):
    def list_policies(self, *, cursor: str | None = None, limit: int | None = None) -> Page[Policy]: ...
    def get_policy(self, name: str) -> Policy: ...
    def create_policy(
        self,
        name: str,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        exist_ok: bool = False,
    ) -> Policy: ...
    def list_revisions(
        self, name: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Revision]: ...
    def resolve(self, ref: str) -> Revision: ...
    def lineage(self, ref: str, *, cursor: str | None = None, limit: int | None = None) -> Page[Revision]: ...
    def list_aliases(
        self, name: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Alias]: ...
    def set_alias(
        self, name: str, alias: str, revision: int | str, *, reason: str | None = None
    ) -> Alias: ...
    def rollback_alias(self, name: str, alias: str, *, reason: str | None = None) -> Alias: ...
    def alias_history(
        self, name: str, alias: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[AliasEvent]: ...
    def record_eval(
        self, ref: str, metric: str, value: float, *, dataset: str | None = None
    ) -> EvalRecord: ...
    def list_evals(
        self, ref: str, *, metric: str | None = None, cursor: str | None = None, limit: int | None = None
    ) -> Page[EvalRecord]: ...
    def export(self, ref: str, dest: str | os.PathLike[str]) -> Revision: ...
    def import_peft(
        self,
        peft_dir: str | os.PathLike[str],
        policy: str,
        *,
        base_model: str | None = None,
        parent: str | None = None,
        training_run: str | None = None,
        step: int | None = None,
        note: str | None = None,
    ) -> Revision: ...
    def seed(
        self,
        n_policies: int,
        revisions_per_policy: int,
        *,
        prefix: str,
        progress: Callable[[int], None] | None,
    ) -> SeedResult: ...
    def gc(self, *, grace_seconds: float, dry_run: bool) -> GcReport: ...
    def create_key(self, name: str, scopes: list[str]) -> tuple[ApiKey, str]: ...
    def list_keys(self, *, include_revoked: bool = False) -> list[ApiKey]: ...
    def revoke_key(self, key_id: str) -> None: ...
    def close(self) -> None: ...


class LocalClient:
    """A Catalog bound to one owner (and the actor recorded on alias moves)."""

    def __init__(self, catalog: Catalog, owner: str, actor: str | None = None) -> None:
        self.catalog = catalog
        self.owner = owner
        self.actor = actor or owner
        self.keys = KeyStore(catalog.engine)

    def create_key(self, name: str, scopes: list[str]) -> tuple[ApiKey, str]:
        from mint_server.api.auth.keys import issue_key  # stdlib only

        return issue_key(self.keys, self.owner, name, scopes)

    def list_keys(self, *, include_revoked: bool = False) -> list[ApiKey]:
        return self.keys.list(self.owner, include_revoked=include_revoked)

    def revoke_key(self, key_id: str) -> None:
        self.keys.revoke(self.owner, key_id)

    def list_policies(self, *, cursor: str | None = None, limit: int | None = None) -> Page[Policy]:
        return self.catalog.list_policies(self.owner, cursor=cursor, limit=limit)

    def get_policy(self, name: str) -> Policy:
        return self.catalog.get_policy(self.owner, name)

    def create_policy(
        self,
        name: str,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        exist_ok: bool = False,
    ) -> Policy:
        create = self.catalog.get_or_create_policy if exist_ok else self.catalog.create_policy
        return create(self.owner, name, base_model, lora_config, metadata)

    def list_revisions(
        self, name: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Revision]:
        return self.catalog.list_revisions(self.owner, name, cursor=cursor, limit=limit)

    def resolve(self, ref: str) -> Revision:
        return self.catalog.resolve(self.owner, ref)

    def lineage(self, ref: str, *, cursor: str | None = None, limit: int | None = None) -> Page[Revision]:
        return self.catalog.lineage(self.owner, ref, cursor=cursor, limit=limit)

    def list_aliases(self, name: str, *, cursor: str | None = None, limit: int | None = None) -> Page[Alias]:
        return self.catalog.list_aliases(self.owner, name, cursor=cursor, limit=limit)

    def set_alias(self, name: str, alias: str, revision: int | str, *, reason: str | None = None) -> Alias:
        return self.catalog.set_alias(self.owner, name, alias, revision, actor=self.actor, reason=reason)

    def rollback_alias(self, name: str, alias: str, *, reason: str | None = None) -> Alias:
        return self.catalog.rollback_alias(self.owner, name, alias, actor=self.actor, reason=reason)

    def alias_history(
        self, name: str, alias: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[AliasEvent]:
        return self.catalog.alias_history(self.owner, name, alias, cursor=cursor, limit=limit)

    def record_eval(self, ref: str, metric: str, value: float, *, dataset: str | None = None) -> EvalRecord:
        return self.catalog.record_eval(self.owner, ref, metric, value, dataset=dataset)

    def list_evals(
        self, ref: str, *, metric: str | None = None, cursor: str | None = None, limit: int | None = None
    ) -> Page[EvalRecord]:
        return self.catalog.list_evals(self.owner, ref, metric=metric, cursor=cursor, limit=limit)

    def export(self, ref: str, dest: str | os.PathLike[str]) -> Revision:
        revision = self.catalog.resolve(self.owner, ref)
        self.catalog.materialize(revision, dest)
        return revision

    def import_peft(
        self,
        peft_dir: str | os.PathLike[str],
        policy: str,
        *,
        base_model: str | None = None,
        parent: str | None = None,
        training_run: str | None = None,
        step: int | None = None,
        note: str | None = None,
    ) -> Revision:
        return self.catalog.import_peft(
            self.owner,
            peft_dir,
            policy,
            base_model=base_model,
            parent=parent,
            training_run=training_run,
            step=step,
            note=note,
        )

    def seed(
        self,
        n_policies: int,
        revisions_per_policy: int,
        *,
        prefix: str,
        progress: Callable[[int], None] | None,
    ) -> SeedResult:
        return seeding.seed(
            self.catalog,
            n_policies, revisions_per_policy, self.owner, prefix=prefix, progress=progress
        )

    def gc(self, *, grace_seconds: float, dry_run: bool) -> GcReport:
        return gc.collect(self.catalog, grace_seconds=grace_seconds, dry_run=dry_run)

    def close(self) -> None:
        self.catalog.close()


_ERRORS: dict[str, type[CatalogError]] = {
    cls.__name__: cls for cls in (NotFound, AlreadyExists, InvalidArgument, InvalidReference, IntegrityError)
}
_BY_STATUS: dict[int, type[CatalogError]] = {
    404: NotFound,
    409: AlreadyExists,
    400: InvalidArgument,
    422: InvalidArgument,
}


def _seg(value: str) -> str:
    """A path segment: names and references need '@' and ':' kept, anything else escaped."""
    return quote(value, safe="@:")


class HttpClient:
    """The catalog routes of a MinT server, authenticated with an API key (X-API-Key header, as the
    Tinker SDK sends it)."""

    def __init__(
        self,
        server: str,
        api_key: str | None = None,
        *,
        timeout: float = 300.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        import httpx

        self.server = server.rstrip("/")
        headers = {"X-API-Key": api_key} if api_key else {}
        self._http = httpx.Client(
            base_url=self.server + API_PREFIX, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx

        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise CatalogError(f"cannot reach MinT server at {self.server}: {e}") from None
        _raise_for_status(response)
        return response

    def _get(self, cls: type[T], path: str, **kwargs: Any) -> T:
        return from_dict(cls, self._send("GET", path, **kwargs).json())

    def _page(self, cls: type[T], path: str, cursor: str | None, limit: int | None, **params: Any) -> Page[T]:
        params = {k: v for k, v in {**params, "cursor": cursor, "limit": limit}.items() if v is not None}
        body = self._send("GET", path, params=params).json()
        return Page([from_dict(cls, item) for item in body["items"]], body.get("next_cursor"))

    def list_policies(self, *, cursor: str | None = None, limit: int | None = None) -> Page[Policy]:
        return self._page(Policy, "/policies", cursor, limit)

    def create_key(self, name: str, scopes: list[str]) -> tuple[ApiKey, str]:
        body = self._send("POST", self.server + KEYS_PREFIX, json={"name": name, "scopes": scopes}).json()
        return from_dict(ApiKey, body), body["key"]

    def list_keys(self, *, include_revoked: bool = False) -> list[ApiKey]:
        body = self._send("GET", self.server + KEYS_PREFIX, params={"include_revoked": include_revoked}).json()
        return [from_dict(ApiKey, k) for k in body["keys"]]

    def revoke_key(self, key_id: str) -> None:
        self._send("DELETE", f"{self.server}{KEYS_PREFIX}/{quote(key_id, safe='')}")

    def get_policy(self, name: str) -> Policy:
        return self._get(Policy, f"/policies/{_seg(name)}")

    def create_policy(
        self,
        name: str,
        base_model: str,
        lora_config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        exist_ok: bool = False,
    ) -> Policy:
        body = {
            "name": name,
            "base_model": base_model,
            "lora_config": lora_config or {},
            "metadata": metadata or {},
            "exist_ok": exist_ok,
        }
        return from_dict(Policy, self._send("POST", "/policies", json=body).json())

    def list_revisions(
        self, name: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[Revision]:
        return self._page(Revision, f"/policies/{_seg(name)}/revisions", cursor, limit)

    def resolve(self, ref: str) -> Revision:
        return self._get(Revision, f"/revisions/{_seg(ref)}")

    def lineage(self, ref: str, *, cursor: str | None = None, limit: int | None = None) -> Page[Revision]:
        return self._page(Revision, f"/revisions/{_seg(ref)}/lineage", cursor, limit)

    def list_aliases(self, name: str, *, cursor: str | None = None, limit: int | None = None) -> Page[Alias]:
        return self._page(Alias, f"/policies/{_seg(name)}/aliases", cursor, limit)

    def set_alias(self, name: str, alias: str, revision: int | str, *, reason: str | None = None) -> Alias:
        body = {"revision": revision, "reason": reason}
        return from_dict(
            Alias, self._send("PUT", f"/policies/{_seg(name)}/aliases/{_seg(alias)}", json=body).json()
        )

    def rollback_alias(self, name: str, alias: str, *, reason: str | None = None) -> Alias:
        path = f"/policies/{_seg(name)}/aliases/{_seg(alias)}/rollback"
        return from_dict(Alias, self._send("POST", path, json={"reason": reason}).json())

    def alias_history(
        self, name: str, alias: str, *, cursor: str | None = None, limit: int | None = None
    ) -> Page[AliasEvent]:
        return self._page(AliasEvent, f"/policies/{_seg(name)}/aliases/{_seg(alias)}/history", cursor, limit)

    def record_eval(self, ref: str, metric: str, value: float, *, dataset: str | None = None) -> EvalRecord:
        body = {"metric": metric, "value": value, "dataset": dataset}
        return from_dict(EvalRecord, self._send("POST", f"/revisions/{_seg(ref)}/evals", json=body).json())

    def list_evals(
        self, ref: str, *, metric: str | None = None, cursor: str | None = None, limit: int | None = None
    ) -> Page[EvalRecord]:
        return self._page(EvalRecord, f"/revisions/{_seg(ref)}/evals", cursor, limit, metric=metric)

    def export(self, ref: str, dest: str | os.PathLike[str]) -> Revision:
        """Download the revision as a tar and unpack it into `dest`, after checking the files hash
        to the revision's sha256 (end-to-end integrity; nothing lands in `dest` otherwise)."""
        import httpx

        revision = self.resolve(ref)
        dest_path, staging = payload.staging_dir(dest)
        try:
            with tempfile.TemporaryDirectory(prefix="mint-export-") as tmp:
                packed = Path(tmp) / "revision.tar"
                # Ask for the exact number so an alias moving meanwhile cannot mix revisions.
                path = f"/revisions/{_seg(revision.ref)}/archive"
                try:
                    with self._http.stream("GET", path, params={"format": "tar"}) as response:
                        if not response.is_success:
                            response.read()
                            _raise_for_status(response)
                        with open(packed, "wb") as out:
                            for chunk in response.iter_bytes(1 << 20):
                                out.write(chunk)
                except httpx.HTTPError as e:
                    raise CatalogError(f"cannot reach MinT server at {self.server}: {e}") from None
                root = archive.unpack(packed, Path(tmp) / "peft")
                files = sorted(p for p in root.iterdir() if p.is_file())
                if payload.manifest_sha256(payload.hash_dir(files)) != revision.sha256:
                    raise IntegrityError(
                        f"downloaded {revision.ref!r} does not match its sha256 {revision.sha256}",
                        field="sha256",
                    )
                for f in files:
                    shutil.move(f, staging / f.name)
            payload.commit_dir(staging, dest_path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return revision

    def import_peft(
        self,
        peft_dir: str | os.PathLike[str],
        policy: str,
        *,
        base_model: str | None = None,
        parent: str | None = None,
        training_run: str | None = None,
        step: int | None = None,
        note: str | None = None,
    ) -> Revision:
        payload.scan_peft_dir(peft_dir)  # fail here, before uploading, on an obviously bad dir
        params = {
            "base_model": base_model,
            "parent": parent,
            "training_run": training_run,
            "step": step,
            "note": note,
        }
        params = {k: v for k, v in params.items() if v is not None}
        with tempfile.TemporaryDirectory(prefix="mint-import-") as tmp:
            packed = archive.pack(peft_dir, Path(tmp) / "upload.tar", "tar")
            with open(packed, "rb") as body:
                response = self._send(
                    "POST",
                    f"/policies/{_seg(policy)}/revisions",
                    params=params,
                    content=body,
                    headers={"Content-Type": archive.MEDIA_TYPES["tar"]},
                )
        return from_dict(Revision, response.json())

    def seed(
        self,
        n_policies: int,
        revisions_per_policy: int,
        *,
        prefix: str,
        progress: Callable[[int], None] | None,
    ) -> SeedResult:
        body = {"policies": n_policies, "revisions_per_policy": revisions_per_policy, "prefix": prefix}
        try:
            result = from_dict(SeedResult, self._send("POST", "/seed", json=body).json())
        except NotFound as e:
            if e.field is not None:
                raise
            # A bare 404 means the route is not mounted, not a missing catalog object.
            raise CatalogError(
                f"server {self.server} does not allow seeding (router built without enable_seed)"
            ) from None
        if progress:
            progress(n_policies)
        return result

    def gc(self, *, grace_seconds: float, dry_run: bool) -> GcReport:
        raise InvalidArgument("gc manages the server's own blob store; run it on the server (local mode)")


def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    body = body if isinstance(body, dict) else {}
    detail = body.get("detail")
    if not isinstance(detail, str):
        detail = (response.text or response.reason_phrase or "").strip()[:300]
    if response.status_code in (401, 403):
        raise CatalogError(f"server refused the request ({response.status_code}): {detail}")
    cls = _ERRORS.get(str(body.get("error"))) or _BY_STATUS.get(response.status_code, CatalogError)
    if cls is CatalogError:
        detail = f"server error {response.status_code}: {detail}"
    raise cls(detail, field=body.get("field"))
