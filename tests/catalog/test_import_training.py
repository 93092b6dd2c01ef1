"""Adapters from elsewhere keep training: `mint import` of a PEFT dir (or archive) written by the real
`peft` library prints the revision's tinker:// path, refuses LoRA variants the engine does not
compute (rsLoRA, DoRA) by name, and the imported revision, read back from the catalog as the engine
reads it, continues training with the first step's loss and gradients equal to PEFT's continuing
from the same adapter on the same batch (tests/tolerance.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tinker import types
from typer.testing import CliRunner

from mint_server.catalog import Catalog
from mint_server.catalog.archive import pack
from mint_server.cli import app
from mint_server.engine.training import Trainer
from mint_server.model.loader import load_model
from mint_server.model.peft_io import load_peft_files
from tests.catalog.helpers import write_peft
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Harness
from tests.engine.test_training import peft_reference, sft_datums
from tests.tiny import make_tiny_checkpoint
from tests.tolerance import for_model

OWNER = "import-owner"
TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]


def mint(*args: str, expect: int = 0, as_json: bool = True) -> Any:
    result = CliRunner().invoke(app, [*args, *(["--json"] if as_json else [])])
    assert result.exit_code == expect, f"mint {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return json.loads(result.stdout) if expect == 0 and as_json else result.output


def peft_library_adapter(base: Path, dest: Path) -> Path:
    """An adapter as PEFT writes it after training elsewhere: its own names, alpha and target list."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(hf, config)
    with torch.no_grad():  # nonzero B as after some training (PEFT's init leaves B random only with init=False)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    # PEFT would also save the whole (unchanged) lm_head base weight of a tied base by default.
    model.save_pretrained(dest, save_embedding_layers=False)
    return dest


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("import-base") / "llama", family="llama", tie=True)


def test_import_prints_the_tinker_path_from_a_dir_and_an_archive(tmp_path: Path) -> None:
    where = ["--data-dir", str(tmp_path / "home"), "--owner", OWNER]
    peft = write_peft(tmp_path / "peft", 1)
    out = mint("import", str(peft), "--policy", "mine", *where)
    assert (out["path"], out["number"]) == ("tinker://mine@1", 1)
    text = mint("import", str(write_peft(tmp_path / "peft2", 2)), "--policy", "mine", *where, as_json=False)
    assert "tinker://mine@2" in text
    archive = pack(write_peft(tmp_path / "peft3", 3), tmp_path / "a.tar", "tar")
    assert mint("import", str(archive), "--policy", "mine", *where)["path"] == "tinker://mine@3"


@pytest.mark.parametrize("flag,why", [("use_rslora", "rank-stabilized LoRA"), ("use_dora", "DoRA")])
def test_import_refuses_rslora_and_dora_by_name(tmp_path: Path, flag: str, why: str) -> None:
    where = ["--data-dir", str(tmp_path / "home"), "--owner", OWNER]
    peft = write_peft(tmp_path / "peft", 1)
    config = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**config, flag: True}))
    err = mint("import", str(peft), "--policy", "mine", *where, expect=2, as_json=False)
    assert f"{flag}=true" in err and why in err
    assert mint("policy", "list", *where)["items"] == []  # nothing half-written


def test_imported_peft_adapter_continues_training_like_peft(base: Path, tmp_path: Path) -> None:
    adapter_dir = peft_library_adapter(base, tmp_path / "from-peft")
    where = ["--data-dir", str(tmp_path / "home"), "--owner", OWNER]
    out = mint("import", str(adapter_dir), "--policy", "elsewhere", "--base-model", str(base), *where)
    assert out["path"] == "tinker://elsewhere@1"

    model = load_model(base, device="cpu", dtype=torch.float32)
    with Catalog.open(None, data_dir=tmp_path / "home") as catalog:  # the bytes the engine reads
        files = catalog.read_payload(catalog.resolve(OWNER, "elsewhere@1"))
    weights = load_peft_files(files, model.config)
    assert (weights.rank, weights.alpha, sorted(weights.weights)) == (4, 12.0, sorted(TARGETS))
    trainer = Harness(model, AdapterRegistry(model.config, num_slots=2, max_rank=8, device="cpu",
                                             dtype=torch.float32), base_model=str(base))
    assert isinstance(trainer, Trainer)
    adapter = trainer.residency.install(weights, trainable=True)
    datums = sft_datums([13, 7, 19], seed=4)

    (got,) = trainer.run([TrainRequest(adapter.id, datums, "cross_entropy")])
    ref_loss, _, params = peft_reference(base, adapter_dir, datums)
    tol = for_model(model.config)
    tol.check_scalar(got.metrics["loss:sum"], ref_loss, sum(d.model_input.length for d in datums), "loss vs PEFT")
    for target, (g_a, g_b) in adapter.grads.items():
        for layer in range(g_a.shape[0]):
            if target == "lm_head":
                prefix = "base_model.model.lm_head"
            else:
                block = "self_attn" if target.endswith(("q_proj", "v_proj")) else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tol.check_rel(g_a[layer], params[f"{prefix}.lora_A.default.weight"].grad, (target, layer, "A"))
            tol.check_rel(g_b[layer], params[f"{prefix}.lora_B.default.weight"].grad, (target, layer, "B"))


def test_a_revision_becomes_a_training_start_on_a_live_server(base: Path, tmp_path: Path) -> None:
    """The server side of create_training_client_from_state on tinker://NAME@N: weights_info gives the
    LoRA config the SDK creates the model with, and the revision turns into a weights-only training
    state holding exactly the imported weights (the engine's load_state starts the model from it)."""
    import asyncio

    import tinker

    from mint_server.api.auth.keys import owner_id
    from mint_server.api.tinker import revision_state
    from mint_server.api.tinker.validate import InvalidInput
    from mint_server.engine import state_io
    from mint_server.model.peft_io import load_peft
    from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine

    adapter_dir = peft_library_adapter(base, tmp_path / "from-peft")
    with LiveServer(tiny_engine(base), tmp_path / "data") as server:
        core = server.service.core
        owner = owner_id(KEY_A)
        core.policies.catalog.import_peft(owner, adapter_dir, "elsewhere", base_model=BASE)
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            info = client.create_rest_client().get_weights_info_by_tinker_path("tinker://elsewhere@1").result()
        finally:
            client.close("success")
        assert (info.base_model, info.lora_rank) == (BASE, 4)
        assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, True)

        states_root = core.stores.ephemeral_root
        assert revision_state.resolve(core.policies, states_root,
                                      "tinker://0123456789abcdef0123456789abcdef:train:0/weights/x",
                                      owner) is None  # checkpoint paths resolve as before
        with pytest.raises(InvalidInput, match="no optimizer state"):
            revision_state.resolve(core.policies, states_root, "tinker://elsewhere@1", owner, with_optimizer=True)
        state = revision_state.resolve(core.policies, states_root, "tinker://elsewhere@1", owner)
        assert state is not None and state.path == "tinker://elsewhere@1" and state.lora.rank == 4
        state_dir = asyncio.run(revision_state.ensure_state(core.work, core.policies, state))
        loaded = state_io.load_state(state_dir, include_optimizer=False)
    assert loaded.optim is None and loaded.base_model == BASE
    expected = load_peft(adapter_dir, load_model(base, device="cpu").config)
    assert loaded.weights.rank == 4 and abs(loaded.weights.alpha - 12.0) < 1e-12
    assert sorted(loaded.weights.weights) == sorted(expected.weights)
    for t, (a, b) in expected.weights.items():
        assert torch.equal(loaded.weights.weights[t][0], a) and torch.equal(loaded.weights.weights[t][1], b), t


def test_create_training_client_from_an_imported_revision_trains_like_peft(base: Path, tmp_path: Path) -> None:
    """`mint import DIR --policy NAME` (against the live server) of an adapter PEFT wrote, then the
    tinker SDK's create_training_client_from_state(tinker://NAME@1) and load_state on an existing
    model of the same LoRA config: the first forward_backward's loss equals PEFT's on the same batch."""
    import tinker

    from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine

    adapter_dir = peft_library_adapter(base, tmp_path / "from-peft")
    datums = sft_datums([13, 7, 19], seed=4)
    with LiveServer(tiny_engine(base), tmp_path / "data") as server:
        out = mint("import", str(adapter_dir), "--policy", "elsewhere", "--base-model", BASE,
                   "--server", server.url, "--api-key", KEY_A)
        assert out["path"] == "tinker://elsewhere@1"
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            tc = client.create_training_client_from_state(out["path"]).result()
            assert tc.get_info().lora_rank == 4
            from_state = tc.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            stepped = tc.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]
            # load_weights by model_id (tinker's load_state; 0.22 / mindlab-toolkit's path) puts the
            # revision's weights back into the trained model
            tc.load_state(out["path"]).result()
            loaded = tc.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]
            with pytest.raises(tinker.BadRequestError, match="no optimizer state"):
                client.create_training_client_from_state_with_optimizer(out["path"]).result()
            small = client.create_lora_training_client(base_model=BASE, rank=2).result()
            with pytest.raises(tinker.BadRequestError, match="does not match"):
                small.load_state(out["path"]).result()
            # same rank and switches but more targets than PEFT trained: the engine refuses by name
            wide = client.create_lora_training_client(base_model=BASE, rank=4).result()
            with pytest.raises(tinker.RequestFailedError, match="do not fit"):
                wide.load_state(out["path"]).result()
        finally:
            client.close("success")
    ref_loss, _, _ = peft_reference(base, adapter_dir, datums)
    tol = for_model(load_model(base, device="cpu", dtype=torch.float32).config)
    tokens = sum(d.model_input.length for d in datums)
    tol.check_scalar(from_state, ref_loss, tokens, "create_training_client_from_state loss vs PEFT")
    tol.check_scalar(loaded, ref_loss, tokens, "load_state loss vs PEFT")
    assert abs(stepped - ref_loss) > 1e-3  # the step moved the weights; load_state brought them back
