"""Shared fixtures. The real SmolLM2 checkpoint is prepared once per machine, not once per test run."""

import logging
import os
from pathlib import Path

import pytest

from mint_server.model import kernels
from mint_server.model.prepare import prepare

# Engines (in-process and `mint serve` subprocesses) run eagerly unless a test asks for the compiled
# step: a background compile per engine would cost every test tens of seconds of CPU.
os.environ.setdefault("MINT_COMPILE", "off")

# Skinny products (kernels.linear) on for up to 8 rows whatever this machine's calibration would
# choose: the fast kernels then take the weight × xᵀ form on every machine, the reference kernels
# F.linear, and the parity suites run both.
kernels.pin_skinny_rows(8)


@pytest.fixture(scope="session")
def mint_test_cache() -> Path:
    """A data dir that outlives test runs ($MINT_TEST_CACHE, default ~/.cache/mint-test)."""
    return Path(os.environ.get("MINT_TEST_CACHE") or Path.home() / ".cache" / "mint-test")


@pytest.fixture(scope="session")
def smollm2_dir(mint_test_cache: Path) -> Path:
    """The prepared HuggingFaceTB/SmolLM2-135M-Instruct HF checkpoint dir (converted on first use)."""
    return prepare(None, mint_test_cache).path


# --- kernels: the parity tests run on both MINT_KERNELS paths -----------------------------------
# Everything runs on the mode the environment selects (default fast). The parity tests below (our
# model vs transformers/PEFT, mixed batches vs each row alone, sampled vs trained logprobs) also run
# on the other mode, so CI checks both paths at the cost of those tests only; `--kernels=both` runs
# every test of these suites on both.
PARITY_FILES = ("tests/model/test_parity.py", "tests/moe/test_moe_model.py", "tests/moe/test_moe_sampling.py",
                "tests/engine/test_sampling.py", "tests/engine/test_training.py", "tests/engine/test_invariance.py")
PARITY_SUITES = ("tests/model/", "tests/moe/", "tests/engine/")
PARITY_WORDS = ("match", "equal", "alone", "isolates")
PARITY_SKIP = ("test_smollm2_logits_match_transformers", "test_bad_requests_fail_alone_and_leave_state_unchanged",
               "test_bad_input_names_the_field_and_leaves_the_batch_alone")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kernels", choices=("parity", "both", "env"), default="parity",
                     help="parity: the parity tests run on MINT_KERNELS=fast and reference, the rest on the "
                          "environment's mode; both: every test of tests/model, moe, engine on both; env: no extra runs")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    choice = metafunc.config.getoption("--kernels")
    path = Path(str(metafunc.definition.path)).resolve()
    rel = path.relative_to(Path(__file__).resolve().parent.parent).as_posix()
    name = metafunc.definition.originalname
    if choice == "env" or not rel.startswith(PARITY_SUITES):
        return
    if choice == "parity" and not (rel in PARITY_FILES and any(w in name for w in PARITY_WORDS)
                                   and name not in PARITY_SKIP):
        return
    metafunc.fixturenames.append("kernels_mode")
    metafunc.parametrize("kernels_mode", ["fast", "reference"], indirect=True)


@pytest.fixture
def kernels_mode(request: pytest.FixtureRequest):
    from mint_server.model import kernels

    with kernels.use(request.param):
        yield request.param


def pytest_unconfigure(config: pytest.Config) -> None:
    """The tinker SDK's heartbeat threads outlive the test servers they talked to and may log a
    warning after pytest has closed its capture streams; that failed write is not a test result, so
    logging stops printing "--- Logging error ---" for it once the session is over."""
    logging.raiseExceptions = False
