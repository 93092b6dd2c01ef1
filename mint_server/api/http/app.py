"""The FastAPI app: `create_app(engine, settings)` wires auth, service, catalog, routes and lifecycle."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from mint_server.api import CATALOG_PREFIX
from mint_server.api.admin import dashboard
from mint_server.api.admin import routes as admin_routes
from mint_server.api.anthropic import routes as anthropic_routes
from mint_server.api.auth import routes as key_routes
from mint_server.api.auth.keys import TRAIN, Authenticator, Principal, Signer
from mint_server.api.catalog.routes import make_catalog_router
from mint_server.api.http import openapi
from mint_server.api.http.jsonsafe import SafeJSONResponse
from mint_server.api.http.metrics import Metrics
from mint_server.api.http.plumbing import BodyLimit, install_error_handlers, needs
from mint_server.api.openai import routes as openai_routes
from mint_server.api.service import Service
from mint_server.api.settings import Settings
from mint_server.api.tinker import rest_routes, rollout_routes, session_routes, training_routes
from mint_server.catalog.catalog import Catalog
from mint_server.catalog.keys import KeyStore
from mint_server.engine.interface import Engine

log = logging.getLogger(__name__)


def catalog_owner(p: Principal = needs(TRAIN)) -> str:
    """Catalog rows are keyed by the same owner id as runs and checkpoints (401 without a valid key,
    403 for a key that cannot train)."""
    return p.owner


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    catalog = Catalog.open(settings.db_url, data_dir=settings.data_dir, store=settings.store_url)
    authenticator = Authenticator(settings.api_keys, Signer.for_data_dir(settings.data_dir), settings.no_auth,
                                  KeyStore(catalog.engine))
    svc = Service(engine, settings, Metrics(), catalog)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        svc.start()
        yield
        log.info("draining in-flight work before exit")
        await svc.shutdown()
        catalog.close()  # after the drain: accepted saves still publish their revisions

    app = FastAPI(
        title="MinT", version="0.1.0", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
    )
    app.state.service = svc
    app.state.authenticator = authenticator
    install_error_handlers(app)
    openapi.install(app, served_base_models=[engine.base_model], limits=getattr(engine, "limits", None))
    app.include_router(session_routes.router)
    app.include_router(session_routes.metrics_router)
    app.include_router(training_routes.router)
    app.include_router(rollout_routes.router)
    app.include_router(rest_routes.router)
    app.include_router(key_routes.router)
    app.include_router(admin_routes.router)
    dashboard.install(app)
    for router in openai_routes.routers:
        app.include_router(router)
    app.include_router(anthropic_routes.router)
    app.include_router(
        make_catalog_router(
            lambda: catalog, catalog_owner, max_upload_bytes=settings.max_body_bytes,
            served_base_models=[engine.base_model], scratch_dir=svc.core.stores.ephemeral_root,
        ),
        prefix=CATALOG_PREFIX,
    )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    return app
