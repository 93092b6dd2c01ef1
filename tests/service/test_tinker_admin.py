"""The rest of tinker 0.38 against a live server: `AdminClient` (usage events, audit log, checkpoint
storage), `search_sessions`, `assign_session_project`, `whoami` with its identity claims, and the
`tinker` CLI itself (the venv's console script, unmodified) — each tenant seeing only its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, batch, train

TINKER_CLI = Path(sys.executable).with_name("tinker")


def hour(dt: datetime) -> str:
    return dt.replace(minute=0, second=0, microsecond=0).isoformat()


def test_admin_client_reports_usage_audit_and_storage(server: LiveServer) -> None:
    a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A, project_id="proj-a")
    tc = a.create_lora_training_client(BASE, rank=4).result()
    train(tc, 2)
    keep = tc.save_state("keep").result().path
    gone = tc.save_state("gone").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 17, 33, 60])
    sample = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)).result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    rest.publish_checkpoint_from_tinker_path(keep).result()
    rest.set_checkpoint_ttl_from_tinker_path(keep, 7200).result()
    rest.delete_checkpoint_from_tinker_path(gone).result()

    admin = tinker.AdminClient(base_url=server.url, api_key=KEY_A)
    now = datetime.now(UTC)
    usage = admin.get_billing_usage(hour(now), hour(now + timedelta(hours=1))).result()
    totals: dict[str, float] = {}
    for e in usage.data:
        info = e.event_info
        totals[info.type] = totals.get(info.type, 0) + getattr(info, "token_count", getattr(info, "count", 0) or 0)
        assert e.estimated_cost_usd is None  # self-hosted: no prices
    trained = 2 * sum(d.model_input.length for d in batch())
    assert totals["training"] == trained
    assert totals["sampling_prefill"] == prompt.length
    assert totals["sampling_sample"] == sum(len(s.tokens) for s in sample.sequences)
    assert totals["checkpoint"] == 2
    storage = [e for e in usage.data if e.event_info.type == "storage"]
    assert storage and all(e.project_id == "proj-a" and e.event_info.gigabyte_hours > 0 for e in storage)
    assert set(usage.sessions) == {e.session_id for e in usage.data if e.session_id}
    with pytest.raises(tinker.BadRequestError, match="hour boundary"):
        admin.get_billing_usage(now.replace(minute=7).isoformat(), hour(now + timedelta(hours=1))).result()

    log = admin.get_audit_log(event_type="checkpoints").result()
    events = [(e.event, e.tinker_path) for e in log.entries]
    assert events == [("checkpoint_created", keep), ("checkpoint_created", gone), ("checkpoint_published", keep),
                      ("checkpoint_ttl_set", keep), ("checkpoint_deleted", gone)]
    assert admin.get_audit_log(event_type="organizations").result().entries == []

    current = admin.get_current_checkpoint_storage_usage().result()
    (item,) = current.data
    assert item.project_id == "proj-a" and item.checkpoint_count == 1
    assert item.size_bytes == rest.list_user_checkpoints().result().checkpoints[0].size_bytes

    # Another tenant sees none of it; a key without the admin scope is refused.
    b = tinker.AdminClient(base_url=server.url, api_key=KEY_B)
    assert b.get_billing_usage(hour(now), hour(now + timedelta(hours=1))).result().data == []
    assert b.get_audit_log().result().entries == []
    assert b.get_current_checkpoint_storage_usage().result().data == []
    train_key = httpx.post(f"{server.url}/api/v1/mint/keys", headers={"X-API-Key": KEY_A},
                           json={"name": "trainer", "scopes": ["train"]}).json()["key"]
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.AdminClient(base_url=server.url, api_key=train_key).get_audit_log().result()
    assert [e.event for e in admin.get_audit_log(event_type="organizations").result().entries] == \
        ["organization_api_key_created"]
    a.close("success")


def test_search_sessions_projects_and_whoami(server: LiveServer) -> None:
    warnings.simplefilter("ignore")  # search_sessions is experimental in the SDK
    nightly = tinker.ServiceClient(base_url=server.url, api_key=KEY_A, user_metadata={"team": "rl"})
    nightly_id = nightly.holder.get_session_id()
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = other.create_lora_training_client(BASE, rank=4).result()
    tc.save_state("w").result()
    other_id = other.holder.get_session_id()
    other.close("success")
    theirs = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    search = types.SessionSearchRequest

    page = rest.search_sessions(search()).result()
    assert [s.session_id for s in page.sessions] == [other_id, nightly_id]  # newest first, own only
    assert page.sessions[0].checkpoints_count == 1 and page.sessions[0].checkpoint_storage_bytes > 0
    assert page.sessions[0].status.type == "client_finished" and page.sessions[0].status.reason.type == "success"
    assert page.sessions[1].status.type == "active"
    found = rest.search_sessions(search(user_metadata={"team": "rl"})).result().sessions
    assert [s.session_id for s in found] == [nightly_id]
    active = rest.search_sessions(search(statuses=[types.ActiveSessionStatusQuery()])).result().sessions
    assert [s.session_id for s in active] == [nightly_id]
    first = rest.search_sessions(search(limit=1)).result()
    second = rest.search_sessions(search(limit=1, cursor=first.next_cursor)).result()
    assert [s.session_id for s in first.sessions + second.sessions] == [other_id, nightly_id]
    assert second.next_cursor is None
    assert rest.search_sessions(search(session_id=theirs.holder.get_session_id())).result().sessions == []

    # Moving a session into a project moves its runs (and so their checkpoints) there.
    rest.assign_session_project(other_id, "moved").result()
    runs = rest.list_training_runs(project_id="moved").result().training_runs
    assert [r.training_run_id for r in runs] == [tc.model_id]
    assert rest.search_sessions(search(project_ids=["moved"])).result().sessions[0].session_id == other_id
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=server.url, api_key=KEY_B).assign_session_project(other_id, "x").result()

    me = rest.whoami().result()
    assert me.user_urn.startswith("mint:key:") and me.email is None
    them = tinker.RestClient(base_url=server.url, api_key=KEY_B).whoami().result()
    assert them.org_urn != me.org_urn and them.user_urn != me.user_urn
    scoped = httpx.post(f"{server.url}/api/v1/mint/keys", headers={"X-API-Key": KEY_A},
                        json={"name": "ci", "scopes": ["train"]}).json()
    mine = tinker.RestClient(base_url=server.url, api_key=scoped["key"]).whoami().result()
    assert mine.user_urn == f"mint:key:{scoped['key_id']}" and mine.org_urn == me.org_urn  # same tenant
    # The key check `tinker auth login` makes, and a scoped key revoking itself (`tinker auth logout`).
    me_key = httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": scoped["key"]}).json()
    assert me_key["name"] == "ci" and me_key["key_id"] == int(scoped["key_id"], 16)
    assert me_key["details"]["user_details"]["email"] == mine.user_urn
    configured = httpx.delete(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": KEY_A})
    assert configured.status_code == 400 and "configured" in configured.json()["detail"]
    assert httpx.delete(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": scoped["key"]}).status_code == 204
    assert httpx.get(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": scoped["key"]}).status_code == 401
    nightly.close("success")
    theirs.close("success")


def tinker_cli(server: LiveServer, home: Path, *args: str, key: str = KEY_A) -> subprocess.CompletedProcess:
    """The venv's `tinker` console script, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "MINT_"))}
    env.update(HOME=str(home), TINKER_BASE_URL=server.url, TINKER_API_KEY=key)
    return subprocess.run([str(TINKER_CLI), *args], env=env, capture_output=True, text=True, timeout=300, cwd=home)


class Cli:
    """The same CLI in this process (`tinker.cli`'s command group, what the console script calls):
    each command runs as in a shell, without paying the SDK's import again."""

    def __init__(self, server: LiveServer, home: Path) -> None:
        self.env = {"HOME": str(home), "TINKER_BASE_URL": server.url}

    def __call__(self, *args: str, ok: bool = True, stdin: str | None = None) -> tuple[int, str]:
        from click.testing import CliRunner
        from tinker.cli.__main__ import main_cli
        from tinker.cli.exceptions import TinkerCliError

        result = CliRunner().invoke(main_cli, list(args), env={**self.env, "TINKER_API_KEY": KEY_A}, input=stdin)
        code, out = result.exit_code, result.output
        if isinstance(result.exception, TinkerCliError):  # what `main()` prints and exits with
            code, out = result.exception.exit_code, f"{out}Error: {result.exception.message}\n{result.exception.details}"
        elif result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        if ok:
            assert code == 0, f"tinker {' '.join(args)}: {out}"
        return code, out


@pytest.mark.skipif(not TINKER_CLI.is_file(), reason="the tinker console script is not installed next to python")
def test_the_tinker_cli_works_unmodified(server: LiveServer, client_a: tinker.ServiceClient, tmp_path: Path) -> None:
    tc = client_a.create_lora_training_client(BASE, rank=4).result()
    train(tc, 1)
    path = tc.save_state("w1").result().path
    tc.save_weights_for_sampler("s1").result()

    proc = tinker_cli(server, tmp_path, "-f", "json", "auth", "whoami")
    assert proc.returncode == 0, proc.stderr
    me = json.loads(proc.stdout)
    assert me["user_urn"].startswith("mint:key:") and me["org_urn"].startswith("tml:organization:")
    proc = tinker_cli(server, tmp_path, "-f", "json", "checkpoint", "list")
    assert proc.returncode == 0, proc.stderr
    listed = json.loads(proc.stdout)
    assert {c["tinker_path"] for c in listed["checkpoints"]} == {path, path.replace("/weights/w1", "/sampler_weights/s1")}

    cli = Cli(server, tmp_path)
    runs = json.loads(cli("-f", "json", "run", "list")[1])
    assert [r["training_run_id"] for r in runs["runs"]] == [tc.model_id]
    cli("checkpoint", "publish", path)
    cli("checkpoint", "set-ttl", path, "--ttl", "7200")
    info = json.loads(cli("-f", "json", "checkpoint", "info", path)[1])
    assert info["public"] is True and info["expires_at"] is not None
    out = json.loads(cli("-f", "json", "checkpoint", "download", path, "-o", str(tmp_path))[1])
    files = sorted(p.name for p in Path(out["destination"]).iterdir())
    assert "adapter_config.json" in files and any(f.endswith(".safetensors") for f in files)
    storage = json.loads(cli("-f", "json", "billing", "checkpoint-storage")[1])
    assert storage["data"][0]["checkpoint_count"] == 2  # the temporary export was deleted again
    # Another tenant's CLI sees none of it (its own process: the SDK shares one connection per process).
    proc = tinker_cli(server, tmp_path, "-f", "json", "checkpoint", "list", key=KEY_B)
    assert proc.returncode == 0 and json.loads(proc.stdout)["checkpoints"] == [], proc.stderr
    # `tinker auth login` checks a pasted key here and stores it; logout forgets it (a pasted key stays live).
    code, out = cli("auth", "login", stdin=KEY_A + "\n")
    assert f"Logged in as {me['user_urn']}" in out
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert [k["key"] for k in stored["keys"].values()] == [KEY_A]
    assert "The API key is still active" in cli("auth", "logout")[1]
    code, out = cli("auth", "login", stdin="tml-not-a-key-here\n", ok=False)
    assert code != 0 and "unknown API key" in out
    assert "Tinker accessible: yes" in cli("auth", "status")[1]
    models = json.loads(cli("-f", "json", "model", "list")[1])
    assert BASE in json.dumps(models)
    # What this server cannot do says so at once.
    code, out = cli("session", "export-trace", client_a.holder.get_session_id(), ok=False)
    assert code != 0 and "not supported" in out
