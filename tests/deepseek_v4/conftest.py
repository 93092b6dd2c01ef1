"""Tiny DeepSeek-V4 checkpoints shared by the V4 tests (session-scoped: built once)."""

import pytest

from tests.deepseek_v4.tiny_v4 import YARN, make_tiny_v4


@pytest.fixture(scope="session")
def v4_dir(tmp_path_factory):
    """Sliding, CSA (rate 4, top-3 indexer), HCA (rate 8) and CSA layers; a hash layer; window 6."""
    return make_tiny_v4(tmp_path_factory.mktemp("v4"), seed=1)


@pytest.fixture(scope="session")
def v4_yarn_dir(tmp_path_factory):
    """The compress rope with YaRN, sigmoid routing scores, no hash layer."""
    return make_tiny_v4(tmp_path_factory.mktemp("v4y"), seed=2, rope_parameters=YARN, scoring_func="sigmoid",
                        mlp_layer_types=["moe"] * 4)
