"""The engine's --threads, --max-fused-tokens and training-memory settings."""

import os

import pytest
import typer

from mint_server.cli.serve import engine_settings
from mint_server.engine.settings import EngineSettings


def test_threads_default_to_the_cores_given_and_bad_values_name_the_flag(tmp_path):
    assert EngineSettings().intra_op_threads() == len(os.sched_getaffinity(0))
    assert EngineSettings(threads=3).intra_op_threads() == 3
    with pytest.raises(ValueError, match="threads"):
        EngineSettings(threads=0).check()
    s = engine_settings(tmp_path, threads=1)
    assert s.threads == 1
    with pytest.raises(typer.BadParameter) as err:
        engine_settings(tmp_path, threads=-2)
    assert err.value.param_hint == "--threads"


def test_max_fused_tokens_flag_sets_the_fused_pass_budget_and_bad_values_name_the_flag(tmp_path):
    assert engine_settings(tmp_path).max_fused_tokens == \
        EngineSettings().max_fused_tokens
    assert engine_settings(tmp_path, max_fused_tokens=4096).max_fused_tokens == 4096
    with pytest.raises(typer.BadParameter) as err:
        engine_settings(tmp_path, max_fused_tokens=0)
    assert err.value.param_hint == "--max-fused-tokens"


def test_training_memory_flags_reach_the_settings_and_bad_values_name_the_flag(tmp_path):
    s = engine_settings(tmp_path, checkpoint_from_tokens=0, logits_chunk_mb=2)
    assert s.checkpoint_from_tokens == 0 and s.logits_chunk_elements() == 2 * 2**20 // 4
    assert not s.keep_freed_memory
    assert engine_settings(tmp_path, keep_freed_memory=True).keep_freed_memory
    for flag, value in (("checkpoint_from_tokens", -1), ("logits_chunk_mb", 0)):
        with pytest.raises(typer.BadParameter) as err:
            engine_settings(tmp_path, **{flag: value})
        assert err.value.param_hint == "--" + flag.replace("_", "-")


def test_batch_invariant_flag_reaches_the_settings_and_is_refused_with_tensor_parallel(tmp_path):
    assert engine_settings(tmp_path, batch_invariant=True).batch_invariant
    assert not engine_settings(tmp_path).batch_invariant
    with pytest.raises(typer.BadParameter, match="batch_invariant is supported on one rank only"):
        engine_settings(tmp_path, tp=2, batch_invariant=True)
