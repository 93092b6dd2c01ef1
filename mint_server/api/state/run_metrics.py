"""Per-step metrics of each training run, recorded server-side: the dashboard's live curves.

Every `forward_backward` result of a run (each chunk the SDK sent) is held until the run's next
`optim_step`; the step then writes one record: the pass metrics reduced the way the SDK reduces
chunks (`name:sum` summed, `name:mean` averaged weighted by datums, `:min`/`:max`), the optimizer's
metrics, the tokens trained, and — for losses fed sampling logprobs (importance_sampling, ppo, cispo,
…) — the KL between the sampler and the trainer on the sampled tokens, as tinker-cookbook computes it:
`kl_sample_train_v1` = mean(sampling − trainer logprob), `kl_sample_train_v2` = ½·mean((sampling −
trainer)²), over positions with a sampling logprob. What only the client knows (rewards) it may
report itself (`POST /api/v1/mint/runs/{run_id}/metrics`); those records carry `reported`.

Records are JSON lines appended to `runs/<rid>/metrics.jsonl`, one write each (a torn last line
after a crash is skipped when read).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from mint_server.api.state.runs import RunStore
from mint_server.api.tinker.validate import InvalidInput
from mint_server.fsutil import DiskFull, full_disk_named

log = logging.getLogger(__name__)

MAX_READ = 10_000  # records per read
MAX_REPORTED = 64  # metrics in one reported record
METRICS_FILE = "metrics.jsonl"


@dataclass
class _Pending:
    """Pass results of one run since its last optimizer step, reduced as they arrive (bounded
    however many passes come before the step): name → [value so far, datums so far]."""

    values: dict[str, list[float]] = field(default_factory=dict)
    tokens: int = 0
    loss_fn: str | None = None

    def add(self, name: str, value: float, datums: int) -> None:
        reduction = name.rpartition(":")[2]
        held = self.values.get(name)
        if held is None:
            self.values[name] = [value * datums if reduction == "mean" else value, datums]
        elif reduction == "sum":
            held[0] += value
        elif reduction == "mean":  # weighted by datums, as the SDK weights chunks
            held[0] += value * datums
        elif reduction == "min":
            held[0] = min(held[0], value)
        elif reduction == "max":
            held[0] = max(held[0], value)
        else:
            held[0] = value  # no reduction the SDK knows: the latest
        if held is not None:
            held[1] += datums  # the weight of a mean: datums (the SDK's), or positions (the KL's)

    def reduced(self) -> dict[str, float]:
        return {name: (v / n if name.endswith(":mean") else v) for name, (v, n) in self.values.items()}


def sample_train_kl(datums: Sequence[types.Datum], output: types.ForwardBackwardOutput) -> tuple[dict[str, float], int]:
    """The cookbook's kl_sample_train_v1/v2 over the datums that carry sampling logprobs, and the
    number of positions they average over (chunks combine weighted by it)."""
    diffs = []
    for datum, out in zip(datums, output.loss_fn_outputs, strict=False):
        sampled, trained = datum.loss_fn_inputs.get("logprobs"), out.get("logprobs")
        if sampled is None or trained is None:
            continue
        s, t = sampled.to_numpy().astype(np.float64), trained.to_numpy().astype(np.float64)
        if s.shape != t.shape:
            continue
        diffs.append((s - t)[s != 0])
    if not diffs or not (diff := np.concatenate(diffs)).size:
        return {}, 0
    kl = {"kl_sample_train_v1:mean": float(diff.mean()), "kl_sample_train_v2:mean": float(0.5 * np.mean(diff**2))}
    return kl, int(diff.size)


class RunMetrics:
    def __init__(self, runs: RunStore) -> None:
        self.runs = runs
        self._pending: dict[str, _Pending] = {}

    def path(self, run_id: str) -> Path:
        return self.runs.run_dir(run_id) / METRICS_FILE

    def forward_backward(self, run_id: str, loss_fn: str, datums: Sequence[types.Datum],
                         output: types.ForwardBackwardOutput) -> None:
        pending = self._pending.setdefault(run_id, _Pending())
        n = max(1, len(datums))
        for name, value in output.metrics.items():
            if isinstance(value, int | float) and math.isfinite(value):
                pending.add(name, float(value), n)
        kl, positions = sample_train_kl(datums, output)
        for name, value in kl.items():  # over every sampled position of the step, not per chunk
            pending.add(name, value, positions)
        pending.tokens += sum(d.model_input.length for d in datums)
        pending.loss_fn = loss_fn

    def optim_step(self, run_id: str, step: int, output: types.OptimStepResponse) -> dict[str, Any]:
        """Close step `step` (1-based: the run's optimizer steps so far) and record it."""
        pending = self._pending.pop(run_id, _Pending())
        metrics = pending.reduced()
        metrics.update({k: float(v) for k, v in (output.metrics or {}).items()
                        if isinstance(v, int | float) and math.isfinite(v)})
        record = {"step": step, "time": time.time(), "tokens": pending.tokens, "loss_fn": pending.loss_fn,
                  "metrics": metrics}
        try:
            with full_disk_named(f"the metrics of run {run_id}"):
                self._append(run_id, record)
        except DiskFull as e:
            # The step is applied already: a full or read-only data dir costs its curve a point, not
            # the step (failing it would tell the client an applied step did not happen).
            log.warning("step %d of %s not recorded: %s", step, run_id, e)
        return record

    def report(self, run_id: str, step: int, metrics: Any) -> dict[str, Any]:
        """Metrics the client computed (rewards, accuracy …) for step `step` of its run."""
        if not isinstance(metrics, dict) or not metrics:
            raise InvalidInput("metrics: must be a non-empty object of metric name → number")
        if len(metrics) > MAX_REPORTED:
            raise InvalidInput(f"metrics: at most {MAX_REPORTED} metrics per report")
        clean = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not 0 < len(name) <= 128 or not name.isprintable():
                raise InvalidInput("metrics: names must be 1-128 printable characters")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidInput(f"metrics[{name!r}]: must be a finite number")
            clean[name] = float(value)
        record = {"step": step, "time": time.time(), "reported": clean}
        with full_disk_named(f"the metrics of run {run_id}"):  # nothing applied yet: a 507 says it all
            self._append(run_id, record)
        return record

    def forget(self, run_id: str) -> None:
        self._pending.pop(run_id, None)

    def read(self, run_id: str, after: int = 0, limit: int = MAX_READ) -> tuple[list[dict[str, Any]], int]:
        """Records after the first `after` lines, and the line count to pass as `after` next."""
        try:
            with open(self.path(run_id), "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return [], after
        complete = lines[:-1]  # the part after the last newline is a line still being written (or torn)
        out = []
        for line in complete[after:after + limit]:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out, min(len(complete), after + limit)

    def _append(self, run_id: str, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        fd = os.open(self.path(run_id), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # end a line torn by a crash, so this record stays whole
            os.write(fd, line)  # one write of the whole line: readers see it whole or not at all
        finally:
            os.close(fd)
