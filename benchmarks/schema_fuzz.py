"""Requests generated from the served OpenAPI spec, sent to a live tiny server: how many are answered
with a server error, and how many schema-valid ones are refused for a reason the schema could state.

    .venv/bin/python -m benchmarks.schema_fuzz --total 30000

Every operation of `/openapi.json` gets rounds of schemathesis cases (positive: the body, query,
path and headers fit the schema; negative: they do not), sent with a valid key to the real app on
the real LocalEngine over a tiny random Llama (the suite's `LiveServer`), until `--total` requests
have been sent. Printed: total sent, the 5xx count, the schema-valid-refused count, and per
operation anything non-zero, with the refusal messages (numbers folded) that made it so.

The rule for "schema-valid refused" (`disagreement`): a positive case answered 400, 413 or 422 is a
disagreement — the server enforced a bound (a length, an int range, a min/max item count, a non-empty
id, a pattern, an enum, a required or mutually exclusive field) that the schema did not state. It is
not a disagreement when the refusal depends on state the schema cannot know: 404 for a made-up id,
401/403 (credentials and scopes), 409 (already exists / not in that state), 410, 429, 507; nor a 400
whose message is in `STATEFUL_REFUSALS` below (each says why the schema cannot express it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mint_server.api.http.jsonsafe import INT64_MAX, INT64_MIN

REFUSED = (400, 413, 422)
# 400s that a schema-valid request can get for a reason no schema can state; each names its why.
STATEFUL_REFUSALS: dict[str, str] = {
    "entries but source_paths has": "as many coefficients as source paths: JSON Schema cannot relate two lengths",
    "values but data has": "a tensor's data as long as its shape's product: JSON Schema cannot multiply",
    "is neither a tar nor a zip file": "an uploaded archive's content, not its JSON",
    "has no adapter_config.json": "a directory's content on the server",
    "is malformed": "a cursor is issued by the server; a made-up one is like a made-up id",
    "does not belong to this listing": "a cursor is issued by the server for one listing",
    "must not be in the future": "depends on the clock",
    "must be after starting_on": "relates two fields' values",
    "request body must be a tar or zip archive": "an uploaded archive's content, not its JSON",
    "elements exceed the limit": "a tensor's dense size is its shape's product: JSON Schema cannot multiply",
    "row pointers": "CSR row pointers relate to the shape, the data and each other",
    "must start at 0": "CSR row pointers relate to each other",
    "one column per value": "CSR columns relate to the data's length",
    "outside the row width": "CSR columns relate to the shape",
    "strictly increasing within each row": "CSR columns relate to each other",
    "the last row pointer": "CSR row pointers relate to the data's length",
    "chat template does not support tools": "what the served model's chat template can render",
    "leave no room in the context length": "a prompt's length in tokens: the tokenizer's business, not JSON's",
    "only text parts are supported": "what the served model can read (the tiny test model reads text only)",
    "best_of is not supported": "best_of is taken only equal to n: JSON Schema cannot relate two values",
    "reads no images": "what the served model can read (the tiny test model reads text only)",
    "not a regular expression": "a regex metric's targets must compile: a property of the text",
}
# Never sent: revoking the presented key would turn every later case into a 401.
SKIPPED = {("DELETE", "/api/v1/auth/apikey/me")}


@dataclass
class Tally:
    """What one operation's cases were answered with."""

    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    disagreements: Counter[str] = field(default_factory=Counter)  # folded message → count
    stateful: int = 0
    seconds: float = 0.0  # generating and sending
    unsatisfiable: int = 0  # rounds in which no case of this mode could be generated
    examples: dict[str, str] = field(default_factory=dict)  # a refused case's body per folded message


def fold(message: str) -> str:
    """A refusal message with its numbers and quoted values folded, so that one rule counts once."""
    message = re.sub(r"'[^']{25,}'|\"[^\"]{25,}\"", "'…'", message)
    return re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", message)[:200]


def refusal_detail(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if key in body:
                value = body[key]
                return value.get("message", str(value)) if isinstance(value, dict) else str(value)
    return text[:200]


def is_stateful(detail: str) -> bool:
    return any(pattern in detail for pattern in STATEFUL_REFUSALS)


# Generated values for how much to sample are clamped to this (schema minimums are 0 or 1, so the
# case stays schema-valid): a fuzz run is about what is refused, not about decoding thousands of
# tokens on two shared CPU cores.
WORK_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of", "num_samples")
MOST_WORK = 4


def _whole_floats_as_ints(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer and schemathesis sends such floats where an integer is
    meant; the server, like the tinker SDK's types, takes an integer field's value only as an integer
    literal (a float id is refused, never truncated), which no schema can state. Sent as `5`: where a
    number is meant, 5 and 5.0 are the same value."""
    if isinstance(value, float) and value.is_integer() and INT64_MIN <= value < INT64_MAX:
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _clamp_work(body: Any, path: str = "") -> None:
    if isinstance(body, dict):
        for name in WORK_FIELDS:
            if type(body.get(name)) is int and body[name] > MOST_WORK:
                body[name] = MOST_WORK
        if "model" in body and ("messages" in body or "prompt" in body) and not path.endswith("count_tokens"):  # the OpenAI faces' default is
            body.setdefault("max_tokens", MOST_WORK)  # the whole context
        if isinstance(body.get("sampling_params"), dict):
            _clamp_work(body["sampling_params"])


def _caller(operation: Any, mode: Any, round_no: int, per_round: int, url: str, key: str, tally: Tally) -> Any:
    """A hypothesis test that sends `per_round` cases of `operation` and records them in `tally`."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings

    @seed(round_no)
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=per_round, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    def call(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict | list):
            case.body = _whole_floats_as_ints(case.body)
        _clamp_work(case.body, case.operation.path)
        response = case.call(base_url=url, headers={"X-API-Key": key}, timeout=120)
        tally.sent += 1
        tally.statuses[response.status_code] += 1
        if response.status_code >= 500:
            tally.server_errors.append(f"{case.method} {case.formatted_path}: {response.status_code} "
                                       f"{response.text[:300]}")  # fmt: skip
        elif mode.is_positive and response.status_code in REFUSED:
            detail = refusal_detail(response.text)
            if is_stateful(detail):
                tally.stateful += 1
            else:
                tally.disagreements[f"{response.status_code} {fold(detail)}"] += 1
                tally.examples.setdefault(fold(detail), f"{case.formatted_path} {case.query or ''} "
                                          f"{json.dumps(case.body, default=str)[:400]} → {detail[:200]}")

    return call


def run_operations(
    url: str, key: str, total: int, negative_share: float, per_round: int,
    on_round: Callable[[int, int], None] | None = None, only: str = "", seeds: list[int] | None = None,
    into: dict[str, Tally] | None = None,
) -> dict[str, Tally]:  # fmt: skip
    """Rounds over every operation (each round `per_round` cases per operation and mode, a new seed)
    until `total` requests are sent; with `seeds`, exactly one round per seed (positive unless
    `negative_share` says otherwise). `into` holds the tallies as they grow."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if (op.method.upper(), op.path) not in SKIPPED
                  and only in f"{op.method.upper()} {op.path}"]
    tallies: dict[str, Tally] = into if into is not None else {}
    sent = 0
    round_no = 0
    negative_every = max(1, round(1 / negative_share)) if negative_share > 0 else 0
    rounds = iter(seeds) if seeds is not None else None
    while sent < total or rounds is not None:
        if rounds is not None:
            round_no = next(rounds, -1)
            if round_no < 0:
                break
        sent_before_round = sent
        mode = GenerationMode.NEGATIVE if negative_every and round_no % negative_every == 1 else GenerationMode.POSITIVE
        for operation in operations:
            name = f"{operation.method.upper()} {operation.path}"
            tally = tallies.setdefault(name, Tally())

            call = _caller(operation, mode, round_no, per_round, url, key, tally)
            before, began = tally.sent, time.monotonic()
            try:
                call()
            except Unsatisfiable:  # e.g. no negative case exists for a body of optional free-form fields
                tally.unsatisfiable += 1
            tally.seconds += time.monotonic() - began
            sent += tally.sent - before
            if sent >= total and rounds is None:
                break
        if sent == sent_before_round:
            raise RuntimeError("a whole round sent nothing")
        if on_round is not None:
            on_round(round_no, sent)
        round_no += 1
    return dict(tallies)


def summary(tallies: dict[str, Tally]) -> dict[str, Any]:
    return {
        "operations": len(tallies),
        "sent": sum(t.sent for t in tallies.values()),
        "server_errors": sum(len(t.server_errors) for t in tallies.values()),
        "schema_valid_refused": sum(sum(t.disagreements.values()) for t in tallies.values()),
        "stateful_refusals": sum(t.stateful for t in tallies.values()),
        "statuses": dict(sorted(sum((t.statuses for t in tallies.values()), Counter()).items())),
        "slowest": {name: round(t.seconds, 1) for name, t in
                    sorted(tallies.items(), key=lambda item: -item[1].seconds)[:8]},
        "nonzero": {
            name: {"server_errors": t.server_errors[:5], "disagreements": dict(t.disagreements),
                   "examples": list(t.examples.values())[:3]}
            for name, t in sorted(tallies.items()) if t.server_errors or t.disagreements
        },
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=30_000, help="requests to send (all operations)")
    parser.add_argument("--per-round", type=int, default=10, help="cases per operation and round")
    parser.add_argument("--negative-share", type=float, default=0.5, help="share of rounds with invalid cases")
    parser.add_argument("--only", default="", help="operations whose 'METHOD /path' holds this text")
    parser.add_argument("--out", type=Path, help="write the summary here as JSON too")
    args = parser.parse_args()

    import torch

    from tests.service.live import KEY_A, LiveServer, tiny_engine
    from tests.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="mint-schema-fuzz-"))
    started = time.monotonic()
    try:
        tiny = make_tiny_checkpoint(root / "tiny", family="llama", tie=True)
        with LiveServer(tiny_engine(tiny), root / "data") as server:
            def progress(round_no: int, sent: int) -> None:
                print(f"round {round_no}: {sent} sent, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
                if args.out:  # the figures so far, so that a run cut short still leaves them
                    figures = {**summary(tallies_so_far), "seconds": round(time.monotonic() - started), "partial": True}
                    args.out.write_text(json.dumps(figures, indent=1))

            tallies_so_far: dict[str, Tally] = {}
            tallies = run_operations(server.url, KEY_A, args.total, args.negative_share, args.per_round, progress,
                                     args.only, into=tallies_so_far)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {**summary(tallies), "seconds": round(time.monotonic() - started)}
    text = json.dumps(figures, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
