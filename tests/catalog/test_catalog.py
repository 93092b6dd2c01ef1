"""The catalog API on real SQLite and PostgreSQL: lifecycle, references, ownership, pagination."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from mint_server.catalog import (
    AlreadyExists,
    Catalog,
    IntegrityError,
    InvalidArgument,
    InvalidReference,
    NotFound,
    Revision,
    db,
)
from mint_server.catalog import seed as seeding
from mint_server.catalog.schema import Base, RevisionRow
from tests.catalog.helpers import BASE_MODEL, LORA, read_dir, write_peft

OWNER = "alice"


def publish(catalog: Catalog, tmp_path: Path, name: str, seed: int, **kw) -> Revision:
    peft = write_peft(tmp_path / f"peft-{name}-{seed}", seed)
    return catalog.publish_revision(OWNER, name, peft, base_model=BASE_MODEL, lora_config=LORA, **kw)


def test_lifecycle(catalog: Catalog, tmp_path: Path) -> None:
    policy = catalog.create_policy(OWNER, "chat", BASE_MODEL, LORA, {"team": "rl"})
    assert (policy.name, policy.owner, policy.lora_config, policy.metadata) == (
        "chat",
        OWNER,
        LORA,
        {"team": "rl"},
    )

    peft1, peft2 = write_peft(tmp_path / "p1", 1), write_peft(tmp_path / "p2", 2)
    r1 = catalog.publish_revision(OWNER, "chat", peft1, base_model=BASE_MODEL, lora_config=LORA, note="first")
    r2 = catalog.publish_revision(
        OWNER,
        "chat",
        peft2,
        base_model=BASE_MODEL,
        lora_config=LORA,
        parent=r1,
        training_run="run-7",
        step=100,
    )
    assert (r1.number, r2.number) == (1, 2)
    assert r1.sha256 != r2.sha256 and r1.rank == 2 and r1.note == "first"
    assert (r2.parent, r2.parent_id, r2.training_run, r2.step) == ("chat@1", r1.id, "run-7", 100)
    assert r1.size == sum(len(b) for b in read_dir(peft1).values())

    alias = catalog.set_alias(OWNER, "chat", "prod", 2, actor="ann", reason="ship it")
    assert (alias.name, alias.revision) == ("prod", 2)
    assert catalog.resolve(OWNER, "chat@prod").number == 2
    back = catalog.rollback_alias(OWNER, "chat", "prod", actor="bob", reason="regression")
    assert back.revision == 1
    assert catalog.resolve(OWNER, "chat@prod") == catalog.get_revision(OWNER, "chat", 1)

    history = catalog.alias_history(OWNER, "chat", "prod").items
    assert [(e.action, e.from_revision, e.to_revision, e.actor, e.reason) for e in history] == [
        ("rollback", 2, 1, "bob", "regression"),
        ("set", None, 2, "ann", "ship it"),
    ]

    out = catalog.materialize(catalog.resolve(OWNER, "chat@1"), tmp_path / "export")
    assert read_dir(out) == read_dir(peft1)
    assert [r.ref for r in catalog.lineage(OWNER, "chat@2").items] == ["chat@2", "chat@1"]


def test_rollback_toggles_and_needs_history(catalog: Catalog, tmp_path: Path) -> None:
    for seed in (1, 2, 3):
        publish(catalog, tmp_path, "p", seed)
    catalog.set_alias(OWNER, "p", "prod", 3, actor="a")
    catalog.set_alias(OWNER, "p", "prod", 1, actor="a")
    assert catalog.rollback_alias(OWNER, "p", "prod", actor="a").revision == 3
    assert catalog.rollback_alias(OWNER, "p", "prod", actor="a").revision == 1  # undoing the rollback
    assert len(catalog.alias_history(OWNER, "p", "prod").items) == 4
    catalog.set_alias(OWNER, "p", "canary", 1, actor="a")
    with pytest.raises(InvalidArgument, match="no earlier revision") as e:
        catalog.rollback_alias(OWNER, "p", "canary", actor="a")
    assert e.value.field == "alias"
    with pytest.raises(NotFound, match="no alias 'nope'"):
        catalog.rollback_alias(OWNER, "p", "nope", actor="a")


def test_alias_can_target_by_alias_or_sha(catalog: Catalog, tmp_path: Path) -> None:
    publish(catalog, tmp_path, "p", 1)
    r2 = publish(catalog, tmp_path, "p", 2)
    catalog.set_alias(OWNER, "p", "staging", 2, actor="a")
    assert catalog.set_alias(OWNER, "p", "prod", "staging", actor="a").revision == 2
    assert catalog.set_alias(OWNER, "p", "old", r2.sha256[:10], actor="a").revision == 2
    assert [a.name for a in catalog.list_aliases(OWNER, "p").items] == ["old", "prod", "staging"]
    assert catalog.get_alias(OWNER, "p", "prod").revision == 2


def test_resolve_forms(catalog: Catalog, tmp_path: Path) -> None:
    r1 = publish(catalog, tmp_path, "m.v1", 1)
    r2 = publish(catalog, tmp_path, "m.v1", 2)
    catalog.set_alias(OWNER, "m.v1", "prod", 1, actor="a")
    assert catalog.resolve(OWNER, "m.v1") == r2  # bare name = latest
    assert catalog.resolve(OWNER, "m.v1@1") == r1
    assert catalog.resolve(OWNER, "m.v1@prod") == r1
    assert catalog.resolve(OWNER, f"m.v1@{r2.sha256[:6]}") == r2
    assert catalog.resolve(OWNER, f"m.v1@{r2.sha256.upper()}") == r2
    assert catalog.resolve(OWNER, f"m.v1@sha256:{r1.sha256[:8]}") == r1


@pytest.mark.parametrize(
    "ref, message",
    [
        ("", "empty"),
        ("bad name", "not a valid policy name"),
        ("p@", "nothing after '@'"),
        ("p@0", "start at 1"),
        ("p@-1", "neither"),
        ("p@a b", "neither"),
        ("p@sha256:abc", "6-64 hex"),
        ("p@1@2", "neither"),
        ("@prod", "not a valid policy name"),
    ],
)
def test_malformed_references(catalog: Catalog, ref: str, message: str) -> None:
    with pytest.raises(InvalidReference, match=message) as e:
        catalog.resolve(OWNER, ref)
    assert e.value.field == "ref"
    if ref:
        assert repr(ref) in str(e.value)  # the message names the reference


def test_missing_references_are_not_found(catalog: Catalog, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="'ghost@1': policy 'ghost' not found"):
        catalog.resolve(OWNER, "ghost@1")
    catalog.create_policy(OWNER, "empty", BASE_MODEL)
    with pytest.raises(NotFound, match="has no revisions"):
        catalog.resolve(OWNER, "empty")
    publish(catalog, tmp_path, "p", 1)
    for ref, message in [
        ("p@9", "no revision 9"),
        ("p@prod", "no alias 'prod'"),
        ("p@abcdef0", "sha256 starts"),
    ]:
        with pytest.raises(NotFound, match=message):
            catalog.resolve(OWNER, ref)


def test_ambiguous_sha_prefix(catalog: Catalog, tmp_path: Path) -> None:
    r1 = publish(catalog, tmp_path, "p", 1)
    # Forge a second revision sharing r1's first 8 hex digits: no real payload will do that.
    twin = r1.sha256[:8] + ("0" if r1.sha256[8] != "0" else "1") * 56
    with catalog._write() as s:
        s.add(
            RevisionRow(
                policy_id=r1.policy_id, number=2, sha256=twin, size=1, rank=1, created_at=r1.created_at
            )
        )
    with pytest.raises(InvalidReference, match="ambiguous"):
        catalog.resolve(OWNER, f"p@{r1.sha256[:8]}")
    assert catalog.resolve(OWNER, f"p@{r1.sha256[:9]}") == r1


def test_identical_payload_shares_blobs_and_resolves_to_newest(catalog: Catalog, tmp_path: Path) -> None:
    peft = write_peft(tmp_path / "same", 5)
    a = catalog.publish_revision(OWNER, "p", peft, base_model=BASE_MODEL, lora_config=LORA)
    b = catalog.publish_revision(OWNER, "p", peft, base_model=BASE_MODEL, lora_config=LORA)
    catalog.publish_revision(OWNER, "q", peft, base_model=BASE_MODEL, lora_config=LORA)
    assert a.sha256 == b.sha256 and (a.number, b.number) == (1, 2)
    assert catalog.resolve(OWNER, f"p@{a.sha256[:12]}").number == 2
    assert len(list(catalog.blobs.iter())) == 2  # config + weights, stored once


def test_validation_errors_name_the_field(catalog: Catalog, tmp_path: Path) -> None:
    peft = write_peft(tmp_path / "ok", 1)
    cases = [
        (lambda: catalog.create_policy(OWNER, "has space", BASE_MODEL), "name"),
        (lambda: catalog.create_policy(OWNER, "p", ""), "base_model"),
        (lambda: catalog.create_policy("", "p", BASE_MODEL), "owner"),
        (lambda: catalog.create_policy(OWNER, "p", BASE_MODEL, {"x": object()}), "lora_config"),
        (lambda: catalog.publish_revision(OWNER, "p", tmp_path / "nope", base_model=BASE_MODEL), "peft_dir"),
        (lambda: catalog.publish_revision(OWNER, "p", peft, base_model=BASE_MODEL, step=-1), "step"),
        (lambda: catalog.list_policies(OWNER, limit=0), "limit"),
        (lambda: catalog.list_policies(OWNER, cursor="!!"), "cursor"),
        (lambda: catalog.set_alias(OWNER, "p", "1abc", 1, actor="a"), "alias"),
        (lambda: catalog.set_alias(OWNER, "p", "deadbeef", 1, actor="a"), "alias"),
        (lambda: catalog.get_revision(OWNER, "p", "prod"), "number"),  # type: ignore[arg-type]
        (lambda: catalog.set_alias(OWNER, "p", "prod", 1, actor=""), "actor"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidArgument) as e:
            call()
        assert e.value.field == field, (field, e.value)
        assert field in str(e.value)


def _poison(peft: Path, value: float, dtype: object) -> None:
    """Rewrite the dir's weights with one `value` (NaN/inf) in them; bf16 as raw bits (numpy has no bf16)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(peft / "adapter_model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name][0, 0] = value
    if dtype == "bf16":
        path = peft / "adapter_model.safetensors"
        raw = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}
        save_file(raw, str(path))
        data = bytearray(path.read_bytes())
        header_len = int.from_bytes(data[:8], "little")
        header = bytes(data[8:8 + header_len]).replace(b'"U16"', b'"BF16"')
        path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + header_len:])
    else:
        save_file(tensors, str(peft / "adapter_model.safetensors"))


def test_bad_peft_dirs(catalog: Catalog, tmp_path: Path) -> None:
    def broken(name: str, mutate) -> Path:
        path = write_peft(tmp_path / name, 1)
        mutate(path)
        return path

    cases = {
        "no weights": broken("a", lambda p: (p / "adapter_model.safetensors").unlink()),
        "no config": broken("b", lambda p: (p / "adapter_config.json").unlink()),
        "bad json": broken("c", lambda p: (p / "adapter_config.json").write_text("{")),
        "not lora": broken(
            "d", lambda p: (p / "adapter_config.json").write_text('{"peft_type": "IA3", "r": 1}')
        ),
        "no rank": broken("e", lambda p: (p / "adapter_config.json").write_text('{"peft_type": "LORA"}')),
        "bad tensors": broken("f", lambda p: (p / "adapter_model.safetensors").write_bytes(b"\xff" * 16)),
        "subdir": broken("g", lambda p: (p / "nested").mkdir()),
        "nan weights": broken("h", lambda p: _poison(p, np.nan, np.float32)),
        "inf bf16 weights": broken("i", lambda p: _poison(p, np.inf, "bf16")),
    }
    for label, path in cases.items():
        with pytest.raises(InvalidArgument) as e:
            catalog.import_peft(OWNER, path, "p")
        assert e.value.field == "peft_dir", label
        assert ("NaN or inf" in str(e.value)) == ("nan" in label or "inf" in label), (label, e.value)
    with pytest.raises(NotFound):
        catalog.get_policy(OWNER, "p")  # nothing was created by the failures


def test_policies(catalog: Catalog, tmp_path: Path) -> None:
    catalog.create_policy(OWNER, "p", BASE_MODEL, LORA)
    with pytest.raises(AlreadyExists, match="'p' already exists"):
        catalog.create_policy(OWNER, "p", BASE_MODEL)
    assert catalog.get_or_create_policy(OWNER, "p", BASE_MODEL).lora_config == LORA
    assert catalog.get_or_create_policy(OWNER, "q", BASE_MODEL).name == "q"
    with pytest.raises(InvalidArgument, match="does not match") as e:
        catalog.get_or_create_policy(OWNER, "p", "other/model")
    assert e.value.field == "base_model"
    other = write_peft(tmp_path / "x", 1)
    with pytest.raises(InvalidArgument, match="base_model"):
        catalog.publish_revision(OWNER, "p", other, base_model="other/model")
    # publish creates missing policies
    rev = publish(catalog, tmp_path, "fresh", 1)
    assert catalog.get_policy(OWNER, "fresh").base_model == BASE_MODEL and rev.number == 1


def test_import_peft_defaults(catalog: Catalog, tmp_path: Path) -> None:
    peft = write_peft(tmp_path / "peft", 3, rank=4)
    rev = catalog.import_peft(OWNER, peft, "imported", note="from disk")
    policy = catalog.get_policy(OWNER, "imported")
    assert policy.base_model == BASE_MODEL  # from adapter_config.json
    assert policy.lora_config == {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    assert (rev.rank, rev.note) == (4, "from disk")


def test_ownership(catalog: Catalog, tmp_path: Path) -> None:
    r1 = publish(catalog, tmp_path, "secret", 1)
    catalog.set_alias(OWNER, "secret", "prod", 1, actor="a")
    catalog.record_eval(OWNER, "secret@1", "acc", 0.9)
    mallory = "mallory"
    calls = [
        lambda: catalog.get_policy(mallory, "secret"),
        lambda: catalog.resolve(mallory, "secret"),
        lambda: catalog.resolve(mallory, "secret@prod"),
        lambda: catalog.resolve(mallory, f"secret@{r1.sha256[:8]}"),
        lambda: catalog.get_revision(mallory, "secret", 1),
        lambda: catalog.list_revisions(mallory, "secret"),
        lambda: catalog.lineage(mallory, "secret@1"),
        lambda: catalog.list_aliases(mallory, "secret"),
        lambda: catalog.get_alias(mallory, "secret", "prod"),
        lambda: catalog.set_alias(mallory, "secret", "prod", 1, actor="m"),
        lambda: catalog.rollback_alias(mallory, "secret", "prod", actor="m"),
        lambda: catalog.alias_history(mallory, "secret", "prod"),
        lambda: catalog.record_eval(mallory, "secret@1", "acc", 0.0),
        lambda: catalog.list_evals(mallory, "secret@1"),
    ]
    for call in calls:
        with pytest.raises(NotFound):
            call()
    assert catalog.list_policies(mallory).items == []
    # Mallory's own "secret" is a different policy; Alice's revision cannot be its parent.
    peft = write_peft(tmp_path / "m", 9)
    with pytest.raises(NotFound) as e:
        catalog.publish_revision(mallory, "secret", peft, base_model=BASE_MODEL, parent=r1)
    assert e.value.field == "parent"
    with pytest.raises(NotFound):
        catalog.publish_revision(mallory, "secret", peft, base_model=BASE_MODEL, parent="secret@1")
    mine = catalog.publish_revision(mallory, "secret", peft, base_model=BASE_MODEL)
    assert mine.number == 1 and mine.policy_id != r1.policy_id
    assert catalog.resolve(OWNER, "secret@prod") == r1
    assert len(catalog.alias_history(OWNER, "secret", "prod").items) == 1


def test_evals(catalog: Catalog, tmp_path: Path) -> None:
    publish(catalog, tmp_path, "p", 1)
    catalog.set_alias(OWNER, "p", "prod", 1, actor="a")
    e1 = catalog.record_eval(OWNER, "p@prod", "accuracy", 0.5, dataset="gsm8k")
    catalog.record_eval(OWNER, "p@1", "loss", 1.25)
    assert (e1.revision, e1.metric, e1.value, e1.dataset) == ("p@1", "accuracy", 0.5, "gsm8k")
    assert [e.metric for e in catalog.list_evals(OWNER, "p").items] == ["loss", "accuracy"]
    assert [e.value for e in catalog.list_evals(OWNER, "p@1", metric="accuracy").items] == [0.5]
    for bad in (float("nan"), float("inf"), "0.5", True):
        with pytest.raises(InvalidArgument) as e:
            catalog.record_eval(OWNER, "p@1", "accuracy", bad)  # type: ignore[arg-type]
        assert e.value.field == "value"


def walk(fetch, limit: int) -> list:
    items, cursor, pages = [], None, 0
    while True:
        page = fetch(cursor=cursor, limit=limit)
        items.extend(page.items)
        pages += 1
        assert pages < 1000
        if page.next_cursor is None:
            return items
        cursor = page.next_cursor


def test_pagination_walks_every_item_once(catalog: Catalog, tmp_path: Path) -> None:
    seeding.seed(catalog, 23, 12, OWNER, prefix="s-")
    names = [p.name for p in walk(lambda **kw: catalog.list_policies(OWNER, **kw), 5)]
    assert names == sorted(names) and len(set(names)) == 23
    numbers = [r.number for r in walk(lambda **kw: catalog.list_revisions(OWNER, "s-000000007", **kw), 5)]
    assert numbers == list(range(12, 0, -1))
    chain = [r.number for r in walk(lambda **kw: catalog.lineage(OWNER, "s-000000007@prod", **kw), 5)]
    assert chain == list(range(12, 0, -1))
    for i in range(11):
        catalog.set_alias(OWNER, "s-000000007", "prod", 1 + i % 12, actor="a")
        catalog.set_alias(OWNER, "s-000000007", f"a{i:02d}", 1, actor="a")
    events = walk(lambda **kw: catalog.alias_history(OWNER, "s-000000007", "prod", **kw), 4)
    assert len(events) == 12 and [e.id for e in events] == sorted((e.id for e in events), reverse=True)
    aliases = [a.name for a in walk(lambda **kw: catalog.list_aliases(OWNER, "s-000000007", **kw), 4)]
    assert aliases == sorted(aliases) and len(aliases) == 12
    for i in range(7):
        catalog.record_eval(OWNER, "s-000000007@3", "m", float(i))
    assert [e.value for e in walk(lambda **kw: catalog.list_evals(OWNER, "s-000000007@3", **kw), 3)] == [
        6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0,
    ]  # fmt: skip


def test_keyset_pages_are_stable_under_inserts(catalog: Catalog) -> None:
    seeding.seed(catalog, 10, 1, OWNER, prefix="k-")
    first = catalog.list_policies(OWNER, limit=5)
    catalog.create_policy(OWNER, "a-earlier", BASE_MODEL)  # sorts before the cursor
    second = catalog.list_policies(OWNER, cursor=first.next_cursor, limit=5)
    seen = [p.name for p in first.items + second.items]
    assert len(seen) == len(set(seen)) == 10 and "a-earlier" not in seen


def test_cursor_from_another_listing_is_rejected(catalog: Catalog) -> None:
    seeding.seed(catalog, 3, 3, OWNER, prefix="c-")
    cursor = catalog.list_revisions(OWNER, "c-000000000", limit=1).next_cursor
    with pytest.raises(InvalidArgument, match="does not belong") as e:
        catalog.list_policies(OWNER, cursor=cursor)
    assert e.value.field == "cursor"


def test_seed(catalog: Catalog, tmp_path: Path) -> None:
    result = seeding.seed(catalog, 50, 3, OWNER, batch_size=20)
    assert (result.policies, result.revisions, result.first_name) == (50, 150, "synthetic-000000000")
    again = seeding.seed(catalog, 5, 1, OWNER)  # continues the numbering
    assert again.first_name == "synthetic-000000050"
    assert catalog.resolve(OWNER, "synthetic-000000049@prod").number == 3
    assert [r.number for r in catalog.lineage(OWNER, "synthetic-000000049").items] == [3, 2, 1]
    history = catalog.alias_history(OWNER, "synthetic-000000049", "prod").items
    assert [(e.from_revision, e.to_revision, e.actor) for e in history] == [(None, 3, "seed")]
    # Seeded revisions are real: they materialize into valid PEFT dirs and verify.
    rev = catalog.resolve(OWNER, "synthetic-000000010@2")
    catalog.verify(rev)
    out = catalog.materialize(rev, tmp_path / "synthetic")
    assert sorted(read_dir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    # Ordinary inserts after seeding get fresh ids (PostgreSQL sequences were advanced).
    created = catalog.create_policy(OWNER, "after-seed", BASE_MODEL)
    assert created.id > catalog.get_policy(OWNER, "synthetic-000000054").id
    new_rev = publish(catalog, tmp_path, "after-seed", 1)
    catalog.set_alias(OWNER, "after-seed", "prod", new_rev.number, actor="a")


def test_materialize_refuses_non_empty_dest(catalog: Catalog, tmp_path: Path) -> None:
    rev = publish(catalog, tmp_path, "p", 1)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("x")
    with pytest.raises(AlreadyExists) as e:
        catalog.materialize(rev, dest)
    assert e.value.field == "dest"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_dir(catalog.materialize(rev, empty)) == read_dir(tmp_path / "peft-p-1")
    checkout = catalog.checkout(rev)
    assert checkout == catalog.checkout(rev) and read_dir(checkout) == read_dir(empty)


def test_corrupt_blob_is_reported_not_served(catalog: Catalog, tmp_path: Path) -> None:
    rev = publish(catalog, tmp_path, "p", 1)
    weights = next(e for e in catalog.manifest(rev) if e.name == "adapter_model.safetensors")
    blob_path = catalog.blobs.path(weights.sha256)  # type: ignore[attr-defined]
    data = bytearray(blob_path.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob_path.write_bytes(bytes(data))

    dest = tmp_path / "out"
    with pytest.raises(IntegrityError, match=f"sha256:{weights.sha256} is corrupt"):
        catalog.materialize(rev, dest)
    assert not dest.exists() and list(tmp_path.glob(".out*")) == []  # nothing half-written
    with pytest.raises(IntegrityError, match=weights.sha256):
        catalog.blobs.read(weights.sha256)
    with pytest.raises(IntegrityError, match=weights.sha256):
        catalog.verify(rev)
    # Publishing the same content again replaces the corrupt copy.
    publish(catalog, tmp_path, "p", 1)
    catalog.verify(rev)
    assert read_dir(catalog.materialize(rev, dest)) == read_dir(tmp_path / "peft-p-1")


def test_missing_blob_is_an_integrity_error(catalog: Catalog, tmp_path: Path) -> None:
    rev = publish(catalog, tmp_path, "p", 1)
    for entry in catalog.manifest(rev):
        catalog.blobs.delete(entry.sha256)
    with pytest.raises(IntegrityError, match="missing"):
        catalog.materialize(rev, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_migrated_schema_matches_models(catalog: Catalog) -> None:
    with catalog.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": db.VERSION_TABLE, "compare_type": True}
        )
        assert compare_metadata(context, Base.metadata) == []
        assert context.get_current_revision() == db.HEAD
    config = Config()
    config.set_main_option("script_location", str(db.MIGRATIONS_DIR))
    assert ScriptDirectory.from_config(config).get_current_head() == db.HEAD


def test_reopen_is_idempotent(db_url: str, data_dir: Path, tmp_path: Path) -> None:
    with Catalog.open(db_url, data_dir=data_dir) as c:
        publish(c, tmp_path, "p", 1)
    with Catalog.open(db_url, data_dir=data_dir) as c:
        assert c.resolve(OWNER, "p").number == 1
