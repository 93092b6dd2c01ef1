"""The web dashboard at /dashboard: policies → revisions (lineage, aliases and their history,
promote and roll back with a confirmation step), evals side by side per revision, training runs with
live curves, the engine's residency tiers and queues, and the caller's share of the tokens served.

Same auth as the API: the login form takes an API key holding the `train` scope and answers with a
cookie holding a signed token for that key (never the key), checked against the key on every request,
so a revoked key's dashboard sessions end with it. The cookie is HttpOnly, SameSite=Strict, scoped
to /dashboard, and Secure whenever the request came over https (a plain-http loopback server can
still log in). Every form that changes something also carries a token derived from the cookie.
Everything shown is looked up by the key's owner: another tenant's policies, runs and revisions are
404s, and of the engine's per-key figures only the caller's own and the total appear.

HTML is rendered by api/admin/dashboard_html.py; catalog reads run off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from mint_server.api.admin import dashboard_html as html
from mint_server.api.auth.keys import TRAIN, AuthError, Principal, ScopeError
from mint_server.api.http.plumbing import BodyTooLarge, service
from mint_server.api.state.runs import NotFound
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.errors import NotFound as CatalogNotFound

COOKIE = "mint_dashboard"
SESSION_S = 12 * 3600
MAX_FORM_BYTES = 16 * 1024
PAGE = 50
POLL_MS = 2000
STATIC_DIR = Path(__file__).with_name("static")
router = APIRouter(prefix="/dashboard", include_in_schema=False)


# --- auth ----------------------------------------------------------------------------------------
async def _viewer(request: Request) -> Principal | None:
    token = request.cookies.get(COOKIE)
    if not token:
        return None
    try:
        p = await asyncio.to_thread(request.app.state.authenticator.from_session, token)
        p.require(TRAIN)
    except (AuthError, ScopeError):
        return None
    return p


def _csrf(request: Request) -> str:
    return request.app.state.authenticator.sign("dashboard-form:" + request.cookies.get(COOKIE, ""))


async def _form(request: Request) -> dict[str, str]:
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise BodyTooLarge(f"form exceeds {MAX_FORM_BYTES} bytes")
    return {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}


def _checked(request: Request, form: dict[str, str]) -> bool:
    return hmac.compare_digest(form.get("csrf", ""), _csrf(request))


def _login_redirect() -> Response:
    return RedirectResponse("/dashboard", status_code=303)


def _who(p: Principal) -> str:
    return f"{p.urn} · tenant {p.owner[:12]}"


def _html(body: str, status: int = 200) -> HTMLResponse:
    # No caching of tenant pages; no framing (clickjacking a promote button).
    return HTMLResponse(body, status_code=status, headers={
        "Cache-Control": "no-store", "X-Frame-Options": "DENY",
        "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    })


def _missing(request: Request, p: Principal, what: str, status: int = 404) -> HTMLResponse:
    return _html(html.problem("Not found" if status == 404 else "Not done", what, _who(p), _csrf(request)), status)


def _refused(request: Request, p: Principal, e: Exception) -> HTMLResponse:
    """A catalog refusal of a move: absent (404), or bad input such as an alias name (400)."""
    return _missing(request, p, str(e), 404 if isinstance(e, CatalogNotFound) else 400)


@router.post("/login")
async def login(request: Request) -> Response:
    key = (await _form(request)).get("api_key", "").strip()
    auth = request.app.state.authenticator
    try:
        p = await asyncio.to_thread(auth.authenticate, key or None)
        p.require(TRAIN)
    except AuthError as e:
        return _html(html.login(f"Not logged in: {e}."), 401)
    except ScopeError as e:
        return _html(html.login(f"Not logged in: {e}."), 403)
    response = RedirectResponse("/dashboard", status_code=303)
    response.set_cookie(COOKIE, auth.issue_session(p, SESSION_S), max_age=SESSION_S, path="/dashboard",
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    response = _login_redirect()
    if _checked(request, await _form(request)):
        response.delete_cookie(COOKIE, path="/dashboard")
    return response


# --- pages ---------------------------------------------------------------------------------------
@router.get("")
async def overview(request: Request, cursor: str | None = None) -> Response:
    p = await _viewer(request)
    if p is None:
        return _html(html.login())
    core = service(request).core
    try:
        page = await asyncio.to_thread(core.policies.catalog.list_policies, p.owner, cursor=cursor, limit=PAGE)
    except InvalidArgument:
        page = await asyncio.to_thread(core.policies.catalog.list_policies, p.owner, limit=PAGE)
    runs = []
    for run in core.stores.runs.list_runs(p.owner)[:PAGE]:
        model = core.stores.models.get(run.run_id)
        runs.append({"run_id": run.run_id, "project_id": run.project_id, "last_request_time": run.last_request_time,
                     "steps": model.steps if model is not None else "—",
                     "checkpoints": len(core.stores.runs.list_checkpoints(run.run_id))})
    return _html(html.overview(page.items, page.next_cursor, runs, engine_figures(request, p), _who(p), _csrf(request)))


def engine_figures(request: Request, p: Principal) -> dict[str, Any]:
    core = service(request).core
    view = core.metrics.engine_view()
    served = view.pop("served")
    pending = core.admission.pending_by_owner
    return {**view, "pending": {"mine": pending.get(p.owner, 0), "total": sum(pending.values())},
            "share": {"mine": float(served.get(p.owner, 0.0)), "total": float(sum(served.values()))}}


@router.get("/policies/{name}")
async def policy_page(name: str, request: Request, cursor: str | None = None, moved: str | None = None) -> Response:
    p = await _viewer(request)
    if p is None:
        return _login_redirect()
    catalog = service(request).core.policies.catalog

    def gather() -> dict[str, Any]:
        policy = catalog.get_policy(p.owner, name)
        aliases = catalog.list_aliases(p.owner, name, limit=100).items
        try:
            revisions = catalog.list_revisions(p.owner, name, cursor=cursor, limit=PAGE)
        except InvalidArgument:
            revisions = catalog.list_revisions(p.owner, name, limit=PAGE)
        evals = {r.id: catalog.list_evals(p.owner, r.ref, limit=100).items for r in revisions.items}
        history = {a.name: catalog.alias_history(p.owner, name, a.name, limit=20).items for a in aliases}
        return {"p": policy, "aliases": aliases, "revisions": revisions.items, "next_cursor": revisions.next_cursor,
                "evals": evals, "history": history}

    try:
        data = await asyncio.to_thread(gather)
    except (CatalogNotFound, InvalidArgument):
        return _missing(request, p, f"No policy {name!r}.")
    flash = f"Alias {moved!r} moved." if moved else None
    return _html(html.policy(**data, who=_who(p), csrf=_csrf(request), flash=flash))


@router.get("/revisions/{ref}")
async def revision_page(ref: str, request: Request) -> Response:
    p = await _viewer(request)
    if p is None:
        return _login_redirect()
    catalog = service(request).core.policies.catalog

    def gather() -> tuple[Any, Any, Any]:
        revision = catalog.resolve(p.owner, ref)
        return revision, catalog.lineage(p.owner, revision.ref, limit=50).items, \
            catalog.list_evals(p.owner, revision.ref, limit=100).items

    try:
        revision, chain, evals = await asyncio.to_thread(gather)
    except (CatalogNotFound, InvalidArgument):
        return _missing(request, p, f"No revision {ref!r}.")
    return _html(html.revision(revision, chain, evals, _who(p), _csrf(request)))


@router.get("/runs/{run_id}")
async def run_page(run_id: str, request: Request, poll_ms: int = Query(POLL_MS, ge=200, le=60_000)) -> Response:
    p = await _viewer(request)
    if p is None:
        return _login_redirect()
    core = service(request).core
    try:
        run = core.stores.runs.get_run(run_id, p.owner)
    except (NotFound, ValueError):
        return _missing(request, p, f"No training run {run_id!r}.")
    checkpoints = [{**asdict(c), "checkpoint_id": c.ref.checkpoint_id, "tinker_path": c.ref.tinker_path}
                   for c in core.stores.runs.list_checkpoints(run.run_id)]
    view = {"run_id": run.run_id, "base_model": run.base_model, "rank": run.lora.get("rank"),
            "project_id": run.project_id, "created_at": run.created_at}
    return _html(html.run(view, checkpoints, _who(p), _csrf(request), poll_ms))


# --- promote and roll back: a confirmation page, then the move -----------------------------------
@router.post("/policies/{name}/promote")
async def promote(name: str, request: Request) -> Response:
    p, form = await _viewer(request), await _form(request)
    if p is None or not _checked(request, form):
        return _login_redirect()
    catalog = service(request).core.policies.catalog
    alias, number = form.get("alias", ""), form.get("revision", "")
    base = f"/dashboard/policies/{html.seg(name)}"
    try:
        current = await asyncio.to_thread(_alias_target, catalog, p.owner, name, alias)
        target = await asyncio.to_thread(catalog.resolve, p.owner, f"{name}@{number}")
        if form.get("confirm") != "yes" or form.get("expect") != str(current):
            moved = form.get("confirm") == "yes"  # confirmed, but the alias moved since: ask again
            question = (f"Move alias <b>{html.h(alias)}</b> of <b>{html.h(name)}</b> "
                        f"{f'from @{current} ' if current is not None else ''}to <b>@{target.number}</b> "
                        f"(<code>{html.h(target.sha256[:12])}</code>)?")
            if moved:
                question = f"The alias moved since you asked. {question}"
            return _html(html.confirm("Promote revision", question, f"{base}/promote",
                                      {"alias": alias, "revision": str(target.number), "expect": str(current)},
                                      base, _who(p), _csrf(request)))
        await asyncio.to_thread(catalog.set_alias, p.owner, name, alias, target.number, actor=p.urn,
                                reason="promoted from the dashboard")
    except (CatalogNotFound, InvalidArgument) as e:
        return _refused(request, p, e)
    return RedirectResponse(f"{base}?moved={quote(alias)}", status_code=303)


@router.post("/policies/{name}/rollback")
async def rollback(name: str, request: Request) -> Response:
    p, form = await _viewer(request), await _form(request)
    if p is None or not _checked(request, form):
        return _login_redirect()
    catalog = service(request).core.policies.catalog
    alias = form.get("alias", "")
    base = f"/dashboard/policies/{html.seg(name)}"
    try:
        current = await asyncio.to_thread(_alias_target, catalog, p.owner, name, alias)
        if current is None:
            return _missing(request, p, f"Policy {name!r} has no alias {alias!r}.")
        if form.get("confirm") != "yes" or form.get("expect") != str(current):
            last = (await asyncio.to_thread(catalog.alias_history, p.owner, name, alias, limit=1)).items[0]
            to = f"@{last.from_revision}" if last.from_revision is not None else "the newest revision before it"
            question = (f"Roll back alias <b>{html.h(alias)}</b> of <b>{html.h(name)}</b> from @{current} "
                        f"to <b>{html.h(to)}</b> (where it pointed before its last move)?")
            return _html(html.confirm("Roll back alias", question, f"{base}/rollback",
                                      {"alias": alias, "expect": str(current)}, base, _who(p), _csrf(request)))
        await asyncio.to_thread(catalog.rollback_alias, p.owner, name, alias, actor=p.urn,
                                reason="rolled back from the dashboard")
    except (CatalogNotFound, InvalidArgument) as e:
        return _refused(request, p, e)
    return RedirectResponse(f"{base}?moved={quote(alias)}", status_code=303)


def _alias_target(catalog: Any, owner: str, name: str, alias: str) -> int | None:
    """The revision number `alias` points at now; None if it does not exist yet."""
    try:
        return catalog.get_alias(owner, name, alias).revision
    except CatalogNotFound as e:
        if e.field == "alias":
            return None
        raise


# --- live data -----------------------------------------------------------------------------------
@router.get("/api/runs/{run_id}/metrics")
async def run_metrics(run_id: str, request: Request, after: int = Query(0, ge=0, le=1 << 40)) -> Response:
    p = await _viewer(request)
    if p is None:
        return JSONResponse({"detail": "not logged in"}, status_code=401)
    try:
        return JSONResponse(service(request).admin.run_metrics(p.owner, run_id, after),
                            headers={"Cache-Control": "no-store"})
    except (NotFound, ValueError):
        return JSONResponse({"detail": f"training run {run_id!r} not found"}, status_code=404)


@router.get("/api/engine")
async def engine(request: Request) -> Response:
    p = await _viewer(request)
    if p is None:
        return JSONResponse({"detail": "not logged in"}, status_code=401)
    figures = engine_figures(request, p)
    share = figures["share"]
    figures["share"]["pct"] = f"{100 * share['mine'] / share['total']:.1f}%" if share["total"] else "—"
    return JSONResponse(figures, headers={"Cache-Control": "no-store"})


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

