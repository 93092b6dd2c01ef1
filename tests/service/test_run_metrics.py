"""Per-step run records (api/state/run_metrics.py): chunks reduced as the SDK reduces them, the
sampler/trainer KL as the cookbook computes it, client reports checked, torn lines survived."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from mint_server.api.state.run_metrics import RunMetrics, sample_train_kl
from mint_server.api.state.runs import RunRecord, RunStore
from mint_server.api.tinker.validate import InvalidInput

RUN = "0123456789abcdef0123456789abcdef:train:0"


def store(tmp_path: Path) -> RunMetrics:
    runs = RunStore(tmp_path / "runs")
    runs.create_run(RunRecord(RUN, "owner", "base", {"rank": 4}, {"type": "adamw"}, "s", 0.0, 0.0))
    return RunMetrics(runs)


def output(metrics: dict[str, float], logprobs: list[list[float]]) -> types.ForwardBackwardOutput:
    return types.ForwardBackwardOutput(loss_fn_output_type="x", metrics=metrics, loss_fn_outputs=[
        {"logprobs": types.TensorData.from_numpy(np.array(lp, np.float32))} for lp in logprobs])


def rl(sampled: list[float]) -> types.Datum:
    n = len(sampled)
    return types.Datum(model_input=types.ModelInput.from_ints(list(range(n))),
                       loss_fn_inputs={"target_tokens": list(range(1, n + 1)), "logprobs": sampled,
                                       "advantages": [1.0] * n})


def test_chunks_reduce_like_the_sdk_and_kl_like_the_cookbook(tmp_path: Path) -> None:
    m = store(tmp_path)
    # Two chunks of one forward_backward: one datum, then two.
    m.forward_backward(RUN, "importance_sampling", [rl([0.0, -1.0, -2.0])],
                       output({"loss:sum": 1.0, "frac:mean": 0.5, "lo:min": 3.0, "hi:max": 1.0}, [[-9.0, -1.5, -2.5]]))
    m.forward_backward(RUN, "importance_sampling", [rl([-1.0]), rl([-1.0])],
                       output({"loss:sum": 2.0, "frac:mean": 0.2, "lo:min": 1.0, "hi:max": 4.0}, [[-1.0], [-3.0]]))
    record = m.optim_step(RUN, 1, types.OptimStepResponse(metrics={"grad_norm:mean": 7.0}))
    got = record["metrics"]
    assert got["loss:sum"] == 3.0 and got["lo:min"] == 1.0 and got["hi:max"] == 4.0
    assert got["frac:mean"] == pytest.approx((0.5 * 1 + 0.2 * 2) / 3)  # weighted by datums
    assert got["grad_norm:mean"] == 7.0 and record["tokens"] == 5 and record["loss_fn"] == "importance_sampling"
    # Over every sampled position of the step; those without a sampling logprob (0: the prompt) are out.
    diff = np.array([-1.0 + 1.5, -2.0 + 2.5, -1.0 + 1.0, -1.0 + 3.0])
    assert got["kl_sample_train_v1:mean"] == pytest.approx(diff.mean())
    assert got["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (diff**2).mean())
    # A step with no pass (or cross-entropy only) records no KL.
    assert "kl_sample_train_v1:mean" not in m.optim_step(RUN, 2, types.OptimStepResponse())["metrics"]
    ce = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    assert sample_train_kl([ce], output({}, [[-1.0, -1.0]])) == ({}, 0)

    records, upto = m.read(RUN)
    assert [r["step"] for r in records] == [1, 2] and upto == 2
    assert m.read(RUN, after=1) == ([records[1]], 2)


def test_reports_are_checked_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    m = store(tmp_path)
    for bad, why in (({}, "non-empty"), ({"r": float("nan")}, "finite"), ({"r": True}, "finite"),
                     ({"r": "1"}, "finite"), ({"": 1.0}, "names")):
        with pytest.raises(InvalidInput, match=why):
            m.report(RUN, 1, bad)
    m.report(RUN, 1, {"reward": 0.5})
    with open(m.path(RUN), "ab") as f:
        f.write(b'{"step": 2, "repor')  # a kill mid-write
    assert [r.get("reported") for r in m.read(RUN)[0]] == [{"reward": 0.5}]  # the torn line is not read yet
    m.report(RUN, 3, {"reward": 0.7})  # the next record starts a line of its own
    lines = m.path(RUN).read_bytes().split(b"\n")
    assert json.loads(lines[-2]) == m.read(RUN)[0][-1] and m.read(RUN)[0][-1]["reported"] == {"reward": 0.7}
    assert len(m.read(RUN)[0]) == 2  # the torn one is skipped
