"""schemathesis over the served OpenAPI spec: requests generated from every route's schema, sent
with a valid key to a live server. None may be answered with a server error, and every status
answered must be one the spec documents for that operation.

And the other direction (issue 52: the schema states every bound the server enforces): a request
generated to fit the schema (schemathesis' positive mode) is never refused with 400, 413 or 422 for
a reason the schema could have stated — a length, an int range, an item count, a non-empty id, a
pattern, an enum, a required or mutually exclusive field. Not disagreements: 404 for a made-up id,
401/403 (credentials, scopes), 409, 410, 429, 507 (state), and a 400 whose message is one of
benchmarks/schema_fuzz.STATEFUL_REFUSALS (each names why no schema can state it: lengths related to
each other, an archive's content, the clock, the served model's abilities, a server-issued cursor).

Bounded: a few examples per operation, no shrinking, so it fits the default suite; the slow variant
and benchmarks/schema_fuzz.py (30,000 requests) run more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.service.live import KEY_A, LiveServer, tiny_engine

EXAMPLES_PER_OPERATION = 8


def _load_lazy_modules() -> None:
    """Import what schemathesis imports lazily, now, at collection. pytest rewrites a plugin's modules
    (ast.parse) as they are imported, and CPython 3.11's AST recursion bookkeeping is shared by the
    interpreter's threads (gh-106905): parsed late in a run, with server and SDK threads alive, it
    once failed this test with "AST constructor recursion depth mismatch"."""
    import schemathesis.transport.requests  # noqa: F401 - case.call

    spec = {"openapi": "3.0.2", "info": {"title": "warm-up", "version": "1"}, "paths": {"/x": {"post": {
        "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
        "responses": {"200": {"description": "ok"}}}}}}  # fmt: skip
    operation = next(iter(schemathesis.openapi.from_dict(spec).get_all_operations())).ok()

    @given(case=operation.as_strategy())
    @settings(max_examples=1, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def draw(case: schemathesis.Case) -> None:
        pass

    draw()


_load_lazy_modules()
SERVER_ERRORS: list[str] = []
UNDOCUMENTED: list[str] = []
DOCUMENTED: dict[tuple[str, str], set[str]] = {}  # (path, method) → the statuses the served spec lists
CALLS: list[int] = []


@pytest.fixture(scope="module")
def live(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("schemathesis") / "data") as server:
        yield server


def test_no_server_errors_and_no_undocumented_status(live: LiveServer) -> None:
    import httpx

    spec = httpx.get(f"{live.url}/openapi.json").json()
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 50
    DOCUMENTED.update({(path, method): set(op["responses"]) for path, ops in spec["paths"].items()
                       for method, op in ops.items()})

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
            phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        def call(case: schemathesis.Case) -> None:
            response = case.call(base_url=live.url, headers={"X-API-Key": KEY_A}, timeout=60)
            CALLS.append(response.status_code)
            if response.status_code >= 500:
                SERVER_ERRORS.append(f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}")
            if str(response.status_code) not in DOCUMENTED[(case.operation.path, case.method.lower())]:
                UNDOCUMENTED.append(f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:200]}")

        call()
    print(f"schemathesis: {len(operations)} operations, {len(CALLS)} requests, "
          f"{len(SERVER_ERRORS)} server errors, {len(UNDOCUMENTED)} undocumented statuses")  # fmt: skip
    assert not SERVER_ERRORS, "\n".join(SERVER_ERRORS[:20])
    assert not UNDOCUMENTED, "\n".join(UNDOCUMENTED[:20])


def _disagreements(live: LiveServer, per_operation: int, seed: int = 0) -> tuple[int, list[str]]:
    from benchmarks.schema_fuzz import run_operations

    tallies = run_operations(live.url, KEY_A, 1, 0.0, per_operation, seeds=[seed])
    found = [f"{name}: {count} × {message}  e.g. {t.examples.get(message.split(' ', 1)[1], '')}"
             for name, t in tallies.items() for message, count in t.disagreements.items()]  # fmt: skip
    return sum(t.sent for t in tallies.values()), found


def test_schema_valid_requests_are_not_refused(live: LiveServer) -> None:
    sent, found = _disagreements(live, per_operation=4)
    assert sent >= 150, sent
    assert not found, "\n".join(found[:20])


@pytest.mark.slow
def test_schema_valid_requests_are_not_refused_many_examples(live: LiveServer) -> None:
    for seed in range(5):
        sent, found = _disagreements(live, per_operation=25, seed=seed)
        assert not found, "\n".join(found[:20])


def test_spec_covers_every_route(live: LiveServer) -> None:
    import httpx

    spec = httpx.get(f"{live.url}/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            takes_body = path.endswith(("/telemetry", "/finish", "/publish", "/auth/token"))
            if method in ("post", "put") and not takes_body:
                assert "requestBody" in op, f"{method.upper()} {path} has no request schema"
    assert httpx.get(f"{live.url}/docs").status_code == 200
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert httpx.get(f"{live.url}/metrics").headers["content-type"].startswith("text/plain")
    for path, operations in spec["paths"].items():
        for op in operations.values():
            assert "422" not in op["responses"], f"{path} documents a 422 the server never answers"


def test_method_not_allowed_says_what_is_allowed(live: LiveServer) -> None:
    import httpx

    r = httpx.request("TRACE", f"{live.url}/api/v1/healthz")
    assert r.status_code == 405 and r.headers["allow"] == "GET", r.headers
    r = httpx.delete(f"{live.url}/api/v1/create_session", headers={"X-API-Key": KEY_A})
    assert r.status_code == 405 and "POST" in r.headers["allow"]
