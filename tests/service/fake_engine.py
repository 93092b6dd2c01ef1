"""A stand-in for the engine, for the service tests that do not depend on model math.

It implements the `Engine` protocol with trivial arithmetic on a worker thread (so futures really
complete later, from another thread, as the real engine's do). Its "loss" is the mean distance of
an adapter scalar from 1.0 and falls with every optimizer step, which is all the protocol-level
tests need. Tests that check real training use `LocalEngine` instead.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from mint_server.engine.interface import EngineError


class FakeEngine:
    def __init__(self, model_dir: Path, base_model: str = "fake/tiny", vocab_size: int = 256, max_context: int = 128):
        self.base_model = base_model
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.delay_s = 0.0
        self.calls: list[str] = []
        self._adapters: dict[str, dict[str, float]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-engine")
        self._lock = threading.Lock()

    def _submit(self, name: str, fn: Any, *args: Any) -> Future[Any]:
        def run() -> Any:
            if self.delay_s:
                time.sleep(self.delay_s)
            with self._lock:
                self.calls.append(name)
                return fn(*args)

        return self._pool.submit(run)

    def _get(self, adapter_id: str | None) -> dict[str, float]:
        if adapter_id is None:
            return {"w": 0.0, "grad": 0.0, "m": 0.0}
        if adapter_id not in self._adapters:
            raise EngineError(f"unknown adapter {adapter_id!r}")
        return self._adapters[adapter_id]

    def create_adapter(self, lora: types.LoraConfig) -> Future[str]:
        def make() -> str:
            aid = uuid.uuid4().hex
            self._adapters[aid] = {"w": 0.0, "grad": 0.0, "m": 0.0, "rank": float(lora.rank)}
            return aid

        return self._submit("create_adapter", make)

    def release_adapter(self, adapter_id: str) -> Future[None]:
        return self._submit("release_adapter", lambda: self._adapters.pop(adapter_id, None) and None)

    def load_peft(self, peft_dir: Path) -> Future[str]:
        def load() -> str:
            cfg = json.loads((peft_dir / "adapter_config.json").read_text())
            aid = uuid.uuid4().hex
            self._adapters[aid] = {"w": cfg["w"], "grad": 0.0, "m": 0.0}
            return aid

        return self._submit("load_peft", load)

    def _outputs(self, a: dict[str, float], datums: list[types.Datum]) -> types.ForwardBackwardOutput:
        loss = abs(1.0 - a["w"])
        outs = []
        for d in datums:
            n = d.model_input.length
            outs.append(
                {
                    "logprobs": types.TensorData(data=np.full(n, -loss, np.float32), dtype="float32", shape=[n]),
                    "elementwise_loss": types.TensorData(data=np.full(n, loss, np.float32), dtype="float32", shape=[n]),
                }
            )
        return types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outs, metrics={"loss:sum": loss * len(datums)}
        )

    def forward(self, adapter_id, datums, loss_fn, loss_fn_config) -> Future[types.ForwardBackwardOutput]:
        return self._submit("forward", lambda: self._outputs(self._get(adapter_id), datums))

    def forward_backward(self, adapter_id, datums, loss_fn, loss_fn_config) -> Future[types.ForwardBackwardOutput]:
        def run() -> types.ForwardBackwardOutput:
            a = self._get(adapter_id)
            a["grad"] += -1.0 if a["w"] < 1.0 else 1.0
            return self._outputs(a, datums)

        return self._submit("forward_backward", run)

    def forward_backward_reverse_kl(self, adapter_id, reference_adapter_id, datums, temperature=1.0):
        def run() -> types.ForwardBackwardOutput:
            a, ref = self._get(adapter_id), self._get(reference_adapter_id)
            a["grad"] += 1.0 if a["w"] > ref["w"] else -1.0
            n = [d.model_input.length for d in datums]
            kl = abs(a["w"] - ref["w"])
            outs = [{"loss": types.TensorData(data=np.full(k, kl, np.float32), dtype="float32", shape=[k])} for k in n]
            return types.ForwardBackwardOutput("ArrayRecord", outs, {"loss:sum": kl * sum(n)})

        return self._submit("forward_backward_reverse_kl", run)

    def optim_step(self, adapter_id: str, params: types.AdamParams) -> Future[types.OptimStepResponse]:
        def run() -> types.OptimStepResponse:
            a = self._get(adapter_id)
            a["m"] = 0.5 * a["m"] + a["grad"]
            a["w"] -= params.learning_rate * a["m"]
            a["grad"] = 0.0
            return types.OptimStepResponse(metrics={"step:unique": 1.0})

        return self._submit("optim_step", run)

    def save_state(self, adapter_id: str, dest: Path, include_optimizer: bool) -> Future[None]:
        def run() -> None:
            a = self._get(adapter_id)
            dest.mkdir(parents=True, exist_ok=True)
            state = {"w": a["w"], **({"m": a["m"]} if include_optimizer else {})}
            (dest / "state.json").write_text(json.dumps(state))

        return self._submit("save_state", run)

    def load_state(self, adapter_id: str, src: Path, include_optimizer: bool) -> Future[None]:
        def run() -> None:
            a = self._get(adapter_id)
            state = json.loads((src / "state.json").read_text())
            a["w"] = state["w"]
            a["m"] = state.get("m", 0.0) if include_optimizer else 0.0

        return self._submit("load_state", run)

    def export_peft(self, adapter_id: str, dest: Path) -> Future[None]:
        def run() -> None:
            a = self._get(adapter_id)
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "adapter_config.json").write_text(json.dumps({"w": a["w"], "peft_type": "LORA"}))
            (dest / "adapter_model.safetensors").write_bytes(b"fake")

        return self._submit("export_peft", run)

    def interpolate(self, adapter_ids: list[str], coefficients: list[float]) -> Future[str]:
        def run() -> str:
            w = sum(c * self._get(a)["w"] for a, c in zip(adapter_ids, coefficients, strict=True))
            aid = uuid.uuid4().hex
            self._adapters[aid] = {"w": w, "grad": 0.0, "m": 0.0}
            return aid

        return self._submit("interpolate", run)

    def sample(self, adapter_id, prompt_tokens, num_samples, params, prompt_logprobs=False, topk_prompt_logprobs=0):
        def run() -> types.SampleResponse:
            a = self._get(adapter_id)
            n = params.max_tokens or 1
            seqs = [
                types.SampledSequence(
                    stop_reason="length",
                    sequence_id=None,  # type: ignore[arg-type]
                    tokens_np=np.array([(prompt_tokens[-1] + i + j) % self.vocab_size for j in range(n)], np.int32),
                    logprobs_np=np.full(n, -abs(a["w"]) - 0.5, np.float32),
                )
                for i in range(num_samples)
            ]
            prompt = None
            if prompt_logprobs:
                prompt = np.full(len(prompt_tokens), -1.0, np.float32)
                prompt[0] = np.nan
            return types.SampleResponse(sequences=seqs, prompt_logprobs_np=prompt)

        return self._submit("sample", run)

    def adapter_count(self) -> int:
        return len(self._adapters)

    def shutdown(self, drain: bool = True) -> None:
        self._pool.shutdown(wait=drain)
