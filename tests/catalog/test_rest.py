"""The REST routes (TestClient and real uvicorn on loopback) and the HTTP client."""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from mint_server.api import CATALOG_PREFIX as API_PREFIX
from mint_server.catalog import AlreadyExists, Catalog, IntegrityError, InvalidReference, NotFound
from mint_server.catalog.archive import pack
from mint_server.cli.catalog_client import HttpClient
from tests.catalog.helpers import BASE_MODEL, read_dir, write_peft


@pytest.fixture
def http(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, base_url=f"http://test{API_PREFIX}", headers={"X-API-Key": "alice"}) as client:
        yield client


def archive_bytes(peft: Path, fmt: str, tmp_path: Path) -> bytes:
    return pack(peft, tmp_path / f"upload-{peft.name}.{fmt}", fmt).read_bytes()  # type: ignore[arg-type]


def test_rest_lifecycle(http: TestClient, tmp_path: Path) -> None:
    r = http.post("/policies", json={"name": "chat", "base_model": BASE_MODEL, "lora_config": {"rank": 2}})
    assert r.status_code == 201 and r.json()["owner"] == "owner-alice"
    p1, p2 = write_peft(tmp_path / "p1", 1), write_peft(tmp_path / "p2", 2)
    r = http.post(
        "/policies/chat/revisions", content=archive_bytes(p1, "tar", tmp_path), params={"note": "one"}
    )
    assert r.status_code == 201, r.text
    assert (r.json()["number"], r.json()["note"]) == (1, "one")
    r = http.post(
        "/policies/chat/revisions", content=archive_bytes(p2, "zip", tmp_path), params={"parent": "chat@1"}
    )
    assert r.status_code == 201 and r.json()["parent"] == "chat@1"

    assert (
        http.put("/policies/chat/aliases/prod", json={"revision": 2, "reason": "ship"}).json()["revision"]
        == 2
    )
    assert http.get("/revisions/chat@prod").json()["number"] == 2
    assert http.post("/policies/chat/aliases/prod/rollback", json={"reason": "bad"}).json()["revision"] == 1
    history = http.get("/policies/chat/aliases/prod/history").json()
    assert [(e["action"], e["from_revision"], e["to_revision"], e["actor"]) for e in history["items"]] == [
        ("rollback", 2, 1, "owner-alice"),
        ("set", None, 2, "owner-alice"),
    ]
    assert [a["name"] for a in http.get("/policies/chat/aliases").json()["items"]] == ["prod"]
    assert [r["number"] for r in http.get("/revisions/chat@2/lineage").json()["items"]] == [2, 1]

    sha = http.get("/revisions/chat@1").json()["sha256"]
    r = http.get(f"/revisions/chat@{sha[:8]}/archive", params={"format": "zip"})
    assert r.status_code == 200 and r.headers["x-mint-revision"] == "chat@1"
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert {n: zf.read(n) for n in zf.namelist()} == read_dir(p1)
    r = http.get("/revisions/chat@prod/archive")
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar} == read_dir(p1)  # type: ignore[union-attr]

    assert http.post("/revisions/chat@prod/evals", json={"metric": "acc", "value": 0.5}).status_code == 201
    evals = http.get("/revisions/chat@1/evals", params={"metric": "acc"}).json()["items"]
    assert [(e["revision"], e["value"]) for e in evals] == [("chat@1", 0.5)]
    assert [p["name"] for p in http.get("/policies").json()["items"]] == ["chat"]
    assert http.get("/policies/chat").json()["lora_config"] == {"rank": 2}


def test_rest_pagination(http: TestClient) -> None:
    assert http.post("/seed", json={"policies": 12, "revisions_per_policy": 3}).status_code == 201
    names, cursor = [], None
    while True:
        body = http.get("/policies", params={"limit": 5, **({"cursor": cursor} if cursor else {})}).json()
        names += [p["name"] for p in body["items"]]
        if not (cursor := body["next_cursor"]):
            break
    assert len(names) == len(set(names)) == 12
    page = http.get("/policies/synthetic-000000003/revisions", params={"limit": 2}).json()
    rest = http.get("/policies/synthetic-000000003/revisions", params={"cursor": page["next_cursor"]}).json()
    assert [r["number"] for r in page["items"] + rest["items"]] == [3, 2, 1] and rest["next_cursor"] is None


def test_rest_errors(http: TestClient, app: FastAPI, catalog: Catalog, tmp_path: Path) -> None:
    def error(response, status: int, *needles: str) -> dict:
        assert response.status_code == status, response.text
        body = response.json()
        assert isinstance(body["detail"], str)
        for needle in needles:
            assert needle in body["detail"]
        return body

    error(http.get("/policies/ghost"), 404, "'ghost'")
    http.post("/policies", json={"name": "p", "base_model": BASE_MODEL})
    error(http.post("/policies", json={"name": "p", "base_model": BASE_MODEL}), 409, "'p' already exists")
    assert (
        http.post("/policies", json={"name": "p", "base_model": BASE_MODEL, "exist_ok": True}).status_code
        == 201
    )
    body = error(http.get("/revisions/p@0"), 400, "'p@0'")
    assert (body["field"], body["error"]) == ("ref", "InvalidReference")
    error(http.get("/revisions/p@prod"), 404, "no alias 'prod'")
    error(http.get("/policies", params={"limit": 0}), 400, "limit")
    error(http.get("/policies", params={"cursor": "garbage"}), 400, "cursor")
    error(http.post("/policies", json={"name": "x"}), 400, "base_model")
    error(http.put("/policies/p/aliases/prod", json={"revision": 1}), 404, "no revision 1")
    error(http.post("/revisions/p/evals", json={"metric": "m", "value": 1}), 404, "no revisions")

    # Uploads: not an archive, not a PEFT dir, or trying to escape the unpack directory.
    error(http.post("/policies/p/revisions", content=b"not an archive"), 400, "neither a tar nor a zip")
    error(http.post("/policies/p/revisions", content=b""), 400, "archive")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("hi")
    error(
        http.post("/policies/p/revisions", content=archive_bytes(empty, "tar", tmp_path)),
        400,
        "adapter_config.json",
    )
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    error(http.post("/policies/p/revisions", content=evil.getvalue()), 400, "unsafe")
    assert not (tmp_path.parent / "escape.txt").exists()

    # Auth is the service's dependency; other owners see nothing.
    with TestClient(app, base_url=f"http://test{API_PREFIX}") as anonymous:
        assert anonymous.get("/policies").status_code == 401
    with TestClient(app, base_url=f"http://test{API_PREFIX}", headers={"X-API-Key": "bob"}) as bob:
        assert bob.get("/policies").json()["items"] == []
        error(bob.get("/policies/p"), 404, "'p'")
        error(bob.put("/policies/p/aliases/prod", json={"revision": 1}), 404)

    # A corrupt blob is a server-side integrity error naming the blob, never a bad archive.
    rev = catalog.publish_revision("owner-alice", "p", write_peft(tmp_path / "c", 1), base_model=BASE_MODEL)
    weights = next(e for e in catalog.manifest(rev) if e.name == "adapter_model.safetensors")
    path = catalog.blobs.path(weights.sha256)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    body = error(http.get("/revisions/p@1/archive"), 500, weights.sha256, "corrupt")
    assert body["error"] == "IntegrityError"


def test_http_client_over_uvicorn(server: str, tmp_path: Path) -> None:
    client = HttpClient(server, "carol")
    try:
        assert client.create_policy("p", BASE_MODEL, {"rank": 2}).owner == "owner-carol"
        with pytest.raises(AlreadyExists):
            client.create_policy("p", BASE_MODEL)
        peft = write_peft(tmp_path / "peft", 4)
        rev = client.import_peft(peft, "p", note="uploaded")
        assert (rev.number, rev.note, rev.policy) == (1, "uploaded", "p")
        client.set_alias("p", "prod", 1, reason="go")
        assert client.resolve("p@prod") == rev
        exported = client.export("p@prod", tmp_path / "out")
        assert exported == rev and read_dir(tmp_path / "out") == read_dir(peft)
        with pytest.raises(NotFound) as e:
            client.resolve("p@9")
        assert e.value.field == "ref"
        with pytest.raises(InvalidReference):
            client.resolve("p@")
        assert client.seed(5, 2, prefix="s-", progress=None).policies == 5
        assert len(client.list_policies(limit=100).items) == 6
    finally:
        client.close()


def test_http_client_export_is_verified_end_to_end(server: str, catalog: Catalog, tmp_path: Path) -> None:
    rev = catalog.publish_revision("owner-dave", "p", write_peft(tmp_path / "peft", 1), base_model=BASE_MODEL)
    config = next(e for e in catalog.manifest(rev) if e.name == "adapter_config.json")
    path = catalog.blobs.path(config.sha256)  # type: ignore[attr-defined]
    path.write_bytes(path.read_bytes().replace(b"LORA", b"LoRA"))
    client = HttpClient(server, "dave")
    try:
        with pytest.raises(IntegrityError, match=config.sha256):
            client.export("p@1", tmp_path / "out")
        assert not (tmp_path / "out").exists()
    finally:
        client.close()
