"""A directory written by the real `peft` library imports and exports byte-for-byte.

Marked slow: importing torch and peft costs more than the rest of the catalog suite's budget.
Run with `pytest -m slow tests/catalog`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mint_server.catalog import Catalog
from tests.catalog.helpers import read_dir


@pytest.mark.slow
def test_real_peft_adapter_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)
            self.v_proj = torch.nn.Linear(8, 8)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.v_proj(self.q_proj(x))

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(Tiny(), config)
    model.save_pretrained(tmp_path / "adapter")

    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", data_dir=tmp_path / "data") as catalog:
        rev = catalog.import_peft("o", tmp_path / "adapter", "tiny", base_model="tiny-test-model")
        assert rev.rank == 4
        assert catalog.get_policy("o", "tiny").lora_config == {
            "rank": 4,
            "alpha": 8,
            "target_modules": ["q_proj", "v_proj"],
            "dropout": 0.0,
        }
        out = catalog.materialize(rev, tmp_path / "out")
    assert read_dir(out) == read_dir(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(Tiny(), str(out))
    key = "base_model.model.q_proj.lora_A.default.weight"
    assert torch.equal(reloaded.state_dict()[key], model.state_dict()[key])
