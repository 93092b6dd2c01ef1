"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright, against a live
server on loopback with two tenants' real training runs, revisions and evals.

Skips (saying why) without Playwright for Python or a Chromium binary ($MINT_CHROMIUM, else
`chromium` on PATH), unless MINT_REQUIRE_BROWSER is set: .ci/run installs Chromium and sets it. With MINT_DASHBOARD_SCREENSHOT=PATH the run page is
also saved there, and the policy page next to it as `<name>-policy.png` (docs/dashboard.png and
docs/dashboard-policy.png are made so).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, batch, tiny_engine, train


def _missing(why: str) -> None:
    """Skip, saying why; where a browser is required (CI sets MINT_REQUIRE_BROWSER=1), fail instead."""
    if os.environ.get("MINT_REQUIRE_BROWSER"):
        pytest.fail(f"the dashboard's browser tests cannot run: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


try:
    from playwright import sync_api
except ImportError:
    _missing("Playwright for Python is not installed (pip install playwright; the browser is the system's Chromium)")
CHROMIUM = os.environ.get("MINT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    _missing("no Chromium binary (apt-get install chromium, or set MINT_CHROMIUM)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 60_000  # a bound on waiting for an event, not a timing assumption


def rl_datum(tokens: list[int]) -> types.Datum:
    """An importance_sampling datum: sampling logprobs make the server record the sampler/trainer KL."""
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [-2.0] * n, "advantages": [1.0] * n})


class World:
    """Two tenants on one server: A has policy `alpha` (revisions 1 and 2, evals on both, prod → 1)
    and a run with curves; B has policy `bravo-secret` and a run of its own."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        self.b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        self.tc = self.a.create_lora_training_client(BASE, rank=4, user_metadata={"policy": "alpha"}).result()
        train(self.tc, 2)
        self.tc.save_weights_for_sampler("first").result()
        self.tc.forward_backward([rl_datum([5, 17, 33, 60, 61, 62, 63, 9])], "importance_sampling").result()
        self.tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        self.tc.save_weights_for_sampler("second").result()
        self.run_a = self.tc.model_id
        self.api_a = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A})
        for step, reward in ((1, 0.1), (2, 0.3), (3, 0.5)):
            self.api_a.post(f"mint/runs/{self.run_a}/metrics", json={"step": step, "metrics": {"reward": reward}}) \
                .raise_for_status()
        for ref, value in (("alpha@1", 0.25), ("alpha@2", 0.75)):
            self.api_a.post(f"mint/catalog/revisions/{ref}/evals",
                            json={"metric": "exact_match", "value": value, "dataset": "arith"}).raise_for_status()
        self.api_a.put("mint/catalog/policies/alpha/aliases/prod", json={"revision": 1}).raise_for_status()
        tb = self.b.create_lora_training_client(BASE, rank=4, user_metadata={"policy": "bravo-secret"}).result()
        train(tb, 1)
        tb.save_weights_for_sampler("b").result()
        self.run_b = tb.model_id

    def prod(self) -> int:
        return self.api_a.get("mint/catalog/policies/alpha/aliases/prod").json()["revision"]

    def close(self) -> None:
        self.api_a.close()
        self.a.close("success")
        self.b.close("success")


@pytest.fixture(scope="module")
def world(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("dashboard") / "data") as server:
        w = World(server)
        yield w
        w.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def logged_in(browser: Any, world: World, key: str) -> Any:
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{world.server.url}/dashboard")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    page.wait_for_selector("#engine")
    return page


def test_login_is_the_api_key_and_a_tenant_cookie(browser: Any, world: World) -> None:
    page = browser.new_context().new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{world.server.url}/dashboard")
    assert page.locator("#api_key").count() == 1  # not logged in: the login form, nothing else
    page.fill("#api_key", "tml-not-a-key-of-this-server")
    page.click("button[type=submit]")
    assert "unknown API key" in page.locator(".error").inner_text()
    # A key that may only sample does not get in.
    serve_key = world.api_a.post("mint/keys", json={"name": "serve-only", "scopes": ["serve"]}).json()["key"]
    page.fill("#api_key", serve_key)
    page.click("button[type=submit]")
    assert "train" in page.locator(".error").inner_text()
    page = logged_in(browser, world, KEY_A)
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/dashboard"
    assert KEY_A not in cookie["value"]  # a signed token, never the key
    # The cookie does not open the API, and the API key does not open the dashboard's JSON.
    assert httpx.get(f"{world.server.url}/api/v1/training_runs", cookies={cookie["name"]: cookie["value"]}).status_code == 401
    assert httpx.get(f"{world.server.url}/dashboard/api/engine", headers={"X-API-Key": KEY_A}).status_code == 401
    page.click("nav button[type=submit]")  # log out
    page.wait_for_selector("#api_key")
    assert page.context.cookies() == []


def test_each_tenant_sees_only_its_own(browser: Any, world: World) -> None:
    a = logged_in(browser, world, KEY_A)
    text = a.content()
    assert "alpha" in text and world.run_a in text
    assert "bravo-secret" not in text and world.run_b not in text
    stats = a.locator("#engine [data-field]")
    assert stats.count() >= 8 and a.locator('[data-field="resident.device"]').inner_text().isdigit()

    b = logged_in(browser, world, KEY_B)
    text = b.content()
    assert "bravo-secret" in text and world.run_b in text
    assert "alpha" not in text and world.run_a not in text
    url = world.server.url
    for path in ("/dashboard/policies/alpha", "/dashboard/revisions/alpha@1", f"/dashboard/runs/{world.run_a}"):
        response = b.goto(url + path)
        assert response.status == 404, path
        assert world.run_a not in b.content() or path.endswith(world.run_a)  # only the id it was asked for
        assert "0.75" not in b.content() and "first" not in b.content()
    response = b.goto(f"{url}/dashboard/api/runs/{world.run_a}/metrics")
    assert response.status == 404 and "loss" not in b.content()


def test_curves_render_and_follow_training_live(browser: Any, world: World, tmp_path: Path) -> None:
    page = logged_in(browser, world, KEY_A)
    page.goto(f"{world.server.url}/dashboard/runs/{world.run_a}?poll_ms=300")
    page.wait_for_function("() => window.mintCharts && window.mintCharts.loss && window.mintCharts.kl "
                           "&& window.mintCharts.reward")
    for chart in ("loss", "kl", "reward", "optim"):
        assert page.locator(f'[data-chart="{chart}"] canvas').count() == 1, chart
    loss = page.evaluate("() => window.mintCharts.loss.data")
    assert loss[0] == [1, 2, 3] and None not in loss[1]
    kl = page.evaluate("() => window.mintCharts.kl.data")
    assert kl[0] == [1, 2, 3] and kl[1][:2] == [None, None] and kl[1][2] is not None  # only the RL step has one
    reward = page.evaluate("() => window.mintCharts.reward.data")
    assert reward[1] == [0.1, 0.3, 0.5]
    # A step taken while the page is open appears without a reload.
    fb = world.tc.forward_backward(batch(), "cross_entropy")
    world.tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    fb.result()
    page.wait_for_function("() => window.mintCharts.loss.data[0].length === 4")
    assert page.locator("#step-count").inner_text() == "4"
    if shot := os.environ.get("MINT_DASHBOARD_SCREENSHOT"):
        page.screenshot(path=shot, full_page=True)


def test_promote_and_roll_back_from_the_page_with_confirmation(browser: Any, world: World) -> None:
    page = logged_in(browser, world, KEY_A)
    page.goto(f"{world.server.url}/dashboard/policies/alpha")
    # Evals side by side: one column, the better revision marked.
    assert page.locator("table.revisions th", has_text="exact_match · arith").count() == 1
    assert page.locator("table.revisions .best").inner_text() == "0.75"
    assert world.prod() == 1
    page.click('button[data-action="promote"][data-revision="2"]')
    assert "from @1 to @2" in page.locator(".question").inner_text()
    page.click("#cancel")  # cancelling changes nothing
    assert world.prod() == 1
    page.click('button[data-action="promote"][data-revision="2"]')
    page.click("#confirm")
    page.wait_for_selector(".flash")
    assert world.prod() == 2
    assert page.locator("#aliases").inner_text().count("@2") == 1
    history = world.api_a.get("mint/catalog/policies/alpha/aliases/prod/history").json()["items"]
    assert history[0]["to_revision"] == 2 and history[0]["actor"].startswith("mint:key:")
    # Roll back: asks first, names where the alias goes, then moves it back.
    page.click('button[data-action="rollback"][data-alias="prod"]')
    assert "from @2 to @1" in page.locator(".question").inner_text()
    page.click("#confirm")
    page.wait_for_selector(".flash")
    assert world.prod() == 1
    assert "rollback" in page.locator("#history").inner_text()
    if shot := os.environ.get("MINT_DASHBOARD_SCREENSHOT"):
        page.screenshot(path=str(Path(shot).with_name(Path(shot).stem + "-policy.png")), full_page=True)
