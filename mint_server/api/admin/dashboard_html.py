"""The dashboard's pages as HTML strings: plain server-rendered markup, one small script
(static/dashboard.js) for the live parts and the vendored uPlot for curves. Every value that comes
from data is escaped here; the routes (api/admin/dashboard.py) only gather what a page shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote

from mint_server.catalog.records import Alias, AliasEvent, EvalRecord, Policy, Revision

STATIC = "/dashboard/static"


def h(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def seg(value: str) -> str:
    """A path segment: every character that could end it or change the path is escaped."""
    return quote(value, safe="")


def when(value: datetime | float | None) -> str:
    if value is None:
        return "—"
    if not isinstance(value, datetime):
        value = datetime.fromtimestamp(value, UTC)
    return f'<time datetime="{h(value.isoformat())}">{h(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"))} UTC</time>'


def num(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.4g}"


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def table(head: Sequence[str], rows: Iterable[Sequence[str]], empty: str, cls: str = "") -> str:
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{h(empty)}</p>'
    head_html = "".join(f"<th>{h(c)}</th>" for c in head)
    return f'<table class="{cls}"><thead><tr>{head_html}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, body: str, *, who: str | None = None, csrf: str | None = None) -> str:
    nav = ""
    if who is not None:
        nav = (f'<nav><a href="/dashboard">Overview</a><span class="who">{h(who)}</span>'
               f'<form method="post" action="/dashboard/logout"><input type="hidden" name="csrf" value="{h(csrf)}">'
               f'<button type="submit">Log out</button></form></nav>')
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{h(title)} · MinT</title>
<link rel="stylesheet" href="{STATIC}/uPlot.min.css"><link rel="stylesheet" href="{STATIC}/dashboard.css">
</head><body><header><a class="brand" href="/dashboard">MinT</a>{nav}</header>
<main><h1>{h(title)}</h1>{body}</main>
<script src="{STATIC}/uPlot.iife.min.js"></script><script src="{STATIC}/dashboard.js"></script>
</body></html>"""


def login(error: str | None = None) -> str:
    message = f'<p class="error" role="alert">{h(error)}</p>' if error else ""
    body = f"""{message}
<form method="post" action="/dashboard/login" class="login">
<label for="api_key">API key</label>
<input id="api_key" name="api_key" type="password" autocomplete="off" required placeholder="tml-…">
<button type="submit">Log in</button>
<p class="hint">A key with the <code>train</code> scope. You see only its tenant's policies, runs and usage.</p>
</form>"""
    return page("Log in", body)


def problem(title: str, message: str, who: str, csrf: str) -> str:
    return page(title, f'<p class="error">{h(message)}</p><p><a href="/dashboard">Back to the overview</a></p>',
                who=who, csrf=csrf)


def overview(policies: Sequence[Policy], next_cursor: str | None, runs: Sequence[dict[str, Any]],
             engine: dict[str, Any], who: str, csrf: str) -> str:
    policy_rows = [(f'<a href="/dashboard/policies/{seg(p.name)}">{h(p.name)}</a>', h(p.base_model),
                    h(p.lora_config.get("rank", "—")), when(p.created_at)) for p in policies]
    more = f'<p><a href="/dashboard?cursor={h(quote(next_cursor))}">More policies →</a></p>' if next_cursor else ""
    run_rows = [(f'<a href="/dashboard/runs/{seg(r["run_id"])}">{h(r["run_id"])}</a>', h(r["steps"]),
                 h(r["checkpoints"]), h(r["project_id"] or "—"), when(r["last_request_time"])) for r in runs]
    body = f"""
<section id="engine" data-poll-ms="5000"><h2>Engine</h2>{engine_panel(engine)}</section>
<section id="policies"><h2>Policies</h2>
{table(("Policy", "Base model", "Rank", "Created"), policy_rows, "No policies yet.")}{more}</section>
<section id="runs"><h2>Training runs</h2>
{table(("Run", "Steps", "Checkpoints", "Project", "Last request"), run_rows, "No training runs yet.")}</section>"""
    return page("Overview", body, who=who, csrf=csrf)


def engine_panel(e: dict[str, Any]) -> str:
    """Residency tiers, queues and this tenant's share of the tokens served (others only as a sum)."""
    def stat(label: str, field: str, value: Any) -> str:
        return f'<div class="stat"><span class="v" data-field="{field}">{h(value)}</span><span class="k">{h(label)}</span></div>'

    tiers = e["resident"]
    share = e["share"]
    pct = f"{100 * share['mine'] / share['total']:.1f}%" if share["total"] else "—"
    return f"""<div class="stats">
{stat("adapters in device slots", "resident.device", tiers.get("device", 0))}
{stat("adapters in host memory", "resident.host", tiers.get("host", 0))}
{stat("adapters in the store (known, not loaded)", "resident.store", tiers.get("store", 0))}
{stat("requests waiting for an adapter", "waiting_for_adapter", e["waiting_for_adapter"])}
{stat("work queued in the engine", "engine_queue", e["engine_queue"])}
{stat("KV blocks in use", "kv_blocks_in_use", e["kv_blocks_in_use"])}
{stat("your requests pending", "pending.mine", e["pending"]["mine"])}
{stat("requests pending (all keys)", "pending.total", e["pending"]["total"])}
{stat("tokens served to you", "share.mine", int(share["mine"]))}
{stat("your share of tokens served", "share.pct", pct)}
</div>"""


def _eval_columns(evals: dict[int, list[EvalRecord]]) -> list[tuple[str, str | None]]:
    seen: dict[tuple[str, str | None], None] = {}
    for records in evals.values():
        for r in records:
            seen.setdefault((r.metric, r.dataset), None)
    return list(seen)


def policy(p: Policy, aliases: Sequence[Alias], revisions: Sequence[Revision], next_cursor: str | None,
           evals: dict[int, list[EvalRecord]], history: dict[str, Sequence[AliasEvent]], who: str, csrf: str,
           flash: str | None = None) -> str:
    base = f"/dashboard/policies/{seg(p.name)}"
    alias_of: dict[int, list[str]] = {}
    for a in aliases:
        alias_of.setdefault(a.revision, []).append(a.name)
    csrf_field = f'<input type="hidden" name="csrf" value="{h(csrf)}">'
    alias_rows = [
        (f'<span class="alias">{h(a.name)}</span>', f'<a href="/dashboard/revisions/{seg(f"{p.name}@{a.revision}")}">@{a.revision}</a>',
         when(a.updated_at),
         f'<form method="post" action="{base}/rollback">{csrf_field}<input type="hidden" name="alias" value="{h(a.name)}">'
         f'<button type="submit" data-action="rollback" data-alias="{h(a.name)}">Roll back…</button></form>')
        for a in aliases
    ]
    columns = _eval_columns(evals)
    best: dict[tuple[str, str | None], float] = {}
    latest: dict[tuple[int, tuple[str, str | None]], float] = {}
    for rev_id, records in evals.items():
        for r in records:  # newest first: the first of a column is the revision's current value
            latest.setdefault((rev_id, (r.metric, r.dataset)), r.value)
    for (_, col), value in latest.items():
        best[col] = max(best.get(col, value), value)
    rows = []
    for r in revisions:
        cells = [f'<a href="/dashboard/revisions/{seg(r.ref)}">@{r.number}</a>'
                 + "".join(f' <span class="alias">{h(a)}</span>' for a in alias_of.get(r.number, [])),
                 f'<code title="{h(r.sha256)}">{h(r.sha256[:12])}</code>',
                 (f'<a href="/dashboard/revisions/{seg(r.parent)}">{h(r.parent)}</a>' if r.parent else "—"),
                 (f'<a href="/dashboard/runs/{seg(r.training_run)}">{h(r.training_run)}</a>' if r.training_run else "—"),
                 h(r.step if r.step is not None else "—"), when(r.created_at)]
        for col in columns:
            value = latest.get((r.id, col))
            mark = ' class="best"' if value is not None and len(revisions) > 1 and value == best[col] else ""
            cells.append(f"<span{mark}>{num(value)}</span>")
        cells.append(
            f'<form method="post" action="{base}/promote" class="inline">{csrf_field}'
            f'<input type="hidden" name="revision" value="{r.number}">'
            f'<input name="alias" value="prod" size="6" aria-label="alias for @{r.number}" pattern="[A-Za-z][A-Za-z0-9_.-]*">'
            f'<button type="submit" data-action="promote" data-revision="{r.number}">Promote…</button></form>')
        rows.append(cells)
    head = ["Revision", "sha256", "Parent", "Training run", "Step", "Created",
            *[f"{m}" + (f" · {d}" if d else "") for m, d in columns], "Promote"]
    more = f'<p><a href="{base}?cursor={h(quote(next_cursor))}">Older revisions →</a></p>' if next_cursor else ""
    history_html = "".join(
        f"<h3>{h(alias)}</h3>" + table(
            ("When", "Action", "From", "To", "By", "Reason"),
            [(when(e.at), h(e.action), h(f"@{e.from_revision}" if e.from_revision is not None else "—"),
              h(f"@{e.to_revision}"), h(e.actor), h(e.reason or "")) for e in events], "No moves.")
        for alias, events in history.items())
    note = f'<p class="flash" role="status">{h(flash)}</p>' if flash else ""
    body = f"""{note}<p class="meta">Base model <code>{h(p.base_model)}</code> · created {when(p.created_at)}</p>
<section id="aliases"><h2>Aliases</h2>{table(("Alias", "Revision", "Moved", ""), alias_rows, "No aliases yet: promote a revision below.")}</section>
<section id="revisions"><h2>Revisions, with their evals side by side</h2>
{table(head, rows, "No revisions yet.", "revisions")}{more}</section>
<section id="history"><h2>Alias history</h2>{history_html or '<p class="empty">No aliases yet.</p>'}</section>"""
    return page(f"Policy {p.name}", body, who=who, csrf=csrf)


def revision(r: Revision, chain: Sequence[Revision], evals: Sequence[EvalRecord], who: str, csrf: str) -> str:
    lineage = " ← ".join(
        f'<a href="/dashboard/revisions/{seg(x.ref)}">{h(x.ref)}</a>' + (f" (step {h(x.step)})" if x.step is not None else "")
        for x in chain)
    eval_rows = [(h(e.metric), h(e.dataset or "—"), num(e.value), when(e.created_at)) for e in evals]
    body = f"""<p class="meta"><code>{h(r.sha256)}</code> · rank {h(r.rank)} · {size(r.size)} · created {when(r.created_at)}
{f' · from run <a href="/dashboard/runs/{seg(r.training_run)}">{h(r.training_run)}</a>' if r.training_run else ""}</p>
<p><a href="/dashboard/policies/{seg(r.policy)}">All revisions of {h(r.policy)}</a></p>
<section id="lineage"><h2>Lineage</h2><p class="lineage">{lineage}</p></section>
<section id="evals"><h2>Evals</h2>{table(("Metric", "Dataset", "Value", "Recorded"), eval_rows, "No evals recorded.")}</section>"""
    return page(f"Revision {r.ref}", body, who=who, csrf=csrf)


def confirm(title: str, question_html: str, action: str, fields: dict[str, str], cancel: str, who: str, csrf: str) -> str:
    hidden = "".join(f'<input type="hidden" name="{h(k)}" value="{h(v)}">' for k, v in fields.items())
    body = f"""<p class="question">{question_html}</p>
<form method="post" action="{h(action)}" class="confirm">
<input type="hidden" name="csrf" value="{h(csrf)}">{hidden}<input type="hidden" name="confirm" value="yes">
<button type="submit" id="confirm">Confirm</button> <a href="{h(cancel)}" id="cancel">Cancel</a></form>"""
    return page(title, body, who=who, csrf=csrf)


def run(run: dict[str, Any], checkpoints: Sequence[dict[str, Any]], who: str, csrf: str, poll_ms: int) -> str:
    rows = [(h(c["checkpoint_id"]), f'<code>{h(c["tinker_path"])}</code>', size(c["size_bytes"]),
             "public" if c["public"] else "private", when(c["created_at"])) for c in checkpoints]
    body = f"""<p class="meta">Base model <code>{h(run["base_model"])}</code> · LoRA rank {h(run["rank"])}
· project {h(run["project_id"] or "—")} · created {when(run["created_at"])}</p>
<section id="curves"><h2>Training curves</h2>
<p class="hint">Recorded by the server at each optimizer step (loss, KL between sampler and trainer); rewards as
the client reports them (<code>POST /api/v1/mint/runs/&lt;run&gt;/metrics</code>). Live: new steps appear as they happen.</p>
<div id="charts" data-run="{h(run["run_id"])}" data-poll-ms="{poll_ms}">
<div class="chart" data-chart="loss"><h3>Loss</h3><p class="empty">No steps yet.</p></div>
<div class="chart" data-chart="reward"><h3>Reward</h3><p class="empty">No rewards reported.</p></div>
<div class="chart" data-chart="kl"><h3>KL (sampler ‖ trainer)</h3><p class="empty">No sampled-data steps yet.</p></div>
<div class="chart" data-chart="optim"><h3>Optimizer</h3><p class="empty">No steps yet.</p></div>
</div><p class="meta">Steps recorded: <span id="step-count">0</span></p></section>
<section id="checkpoints"><h2>Checkpoints</h2>{table(("Checkpoint", "Path", "Size", "Visibility", "Saved"), rows, "No checkpoints yet.")}</section>"""
    return page(f"Run {run['run_id']}", body, who=who, csrf=csrf)
