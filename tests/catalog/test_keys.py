"""The scoped-key store on both backends: what it keeps (never the key), owners kept apart,
revocation, and its bounds."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from mint_server.api.auth.keys import (
    Authenticator,
    AuthError,
    Signer,
    granted,
    issue_key,
    owner_id,
    parse_scopes,
)
from mint_server.catalog import Catalog, InvalidArgument, KeyStore, NotFound
from mint_server.catalog import keys as keys_module
from mint_server.catalog.schema import ApiKeyRow


def test_keys_are_kept_hashed_and_owners_apart(catalog: Catalog) -> None:
    store = KeyStore(catalog.engine)
    record, key = issue_key(store, "owner-a", "app", ["serve"])
    issue_key(store, "owner-b", "other", ["train"])
    with Session(catalog.engine) as s:
        rows = list(s.scalars(select(ApiKeyRow)))
    assert len(rows) == 2
    mine = next(r for r in rows if r.owner == "owner-a")
    assert mine.digest == owner_id(key) and key not in {getattr(mine, c) for c in ("key_id", "digest", "name")}
    assert key.startswith(f"tml-mk_{record.key_id}_") and record.scopes == ["serve"]
    assert [k.name for k in store.list("owner-a")] == ["app"]
    with pytest.raises(NotFound):  # another owner's key looks absent, and stays live
        store.revoke("owner-b", record.key_id)
    assert store.get(record.key_id)[0].revoked_at is None
    revoked = store.revoke("owner-a", record.key_id)
    assert revoked.revoked_at is not None
    assert store.revoke("owner-a", record.key_id).revoked_at == revoked.revoked_at  # idempotent
    assert store.list("owner-a") == [] and [k.key_id for k in store.list("owner-a", include_revoked=True)] == [
        record.key_id]


def test_authenticator_reads_the_store_on_every_request(catalog: Catalog, tmp_path) -> None:
    store = KeyStore(catalog.engine)
    auth = Authenticator(("tml-configured-key",), Signer(b"s" * 32), no_auth=False, keys=store)
    record, key = issue_key(store, "owner-a", "app", ["train"])
    p = auth.authenticate(key)
    assert (p.owner, p.scopes, p.key_id) == ("owner-a", frozenset({"serve", "train"}), record.key_id)
    token = auth.issue_jwt(p)
    assert auth.authenticate(token).scopes == p.scopes
    forged = key[:-1] + ("0" if key[-1] != "0" else "1")  # right key id, wrong secret
    with pytest.raises(AuthError, match="unknown"):
        auth.authenticate(forged)
    KeyStore(catalog.engine).revoke("owner-a", record.key_id)  # another handle on the same database
    for credential in (key, token):
        with pytest.raises(AuthError, match="revoked"):
            auth.authenticate(credential)
    assert auth.authenticate("tml-configured-key").scopes == frozenset({"serve", "train", "admin"})


@pytest.mark.parametrize(("scopes", "why"), [
    ([], "non-empty"), (["serve", "root"], "unknown scope 'root'"), ([3], "non-empty list"), (None, "non-empty"),
])  # fmt: skip
def test_bad_scopes_are_refused_by_name(catalog: Catalog, scopes: object, why: str) -> None:
    store = KeyStore(catalog.engine)
    with pytest.raises(InvalidArgument, match=why) as e:
        issue_key(store, "owner-a", "app", scopes)
    assert e.value.field == "scopes" and store.list("owner-a", include_revoked=True) == []


@pytest.mark.parametrize("name", ["", "x" * 129, "tab\there", 7])
def test_bad_names_are_refused(catalog: Catalog, name: object) -> None:
    store = KeyStore(catalog.engine)
    with pytest.raises(InvalidArgument, match="name"):
        issue_key(store, "owner-a", name, ["serve"])  # type: ignore[arg-type]
    assert store.list("owner-a", include_revoked=True) == []


def test_live_keys_per_owner_are_bounded(catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_module, "MAX_KEYS_PER_OWNER", 3)
    store = KeyStore(catalog.engine)
    made = [issue_key(store, "owner-a", f"k{i}", ["serve"])[0] for i in range(3)]
    with pytest.raises(InvalidArgument, match="at most 3 live keys"):
        issue_key(store, "owner-a", "k3", ["serve"])
    issue_key(store, "owner-b", "k0", ["serve"])  # the bound is per owner
    store.revoke("owner-a", made[0].key_id)
    issue_key(store, "owner-a", "k3", ["serve"])  # a revoked key frees its place


def test_scopes_nest() -> None:
    assert granted(["serve"]) == {"serve"}
    assert granted(["train"]) == {"serve", "train"}
    assert granted(["admin"]) == {"serve", "train", "admin"}
    assert parse_scopes(["admin", "serve"]) == ["serve", "admin"] and parse_scopes("train") == ["train"]
