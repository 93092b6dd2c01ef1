"""Tiny gpt-oss and GLM-5 checkpoints shared by the family tests (session-scoped: built once)."""

import pytest

from tests.families.tiny_families import make_tiny_glm, make_tiny_gpt_oss


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory):
    return make_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss")


@pytest.fixture(scope="session")
def glm_dir(tmp_path_factory):
    return make_tiny_glm(tmp_path_factory.mktemp("glm") / "glm-5")
