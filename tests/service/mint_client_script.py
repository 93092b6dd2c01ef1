"""Drives a MinT server with mindlab-toolkit 0.2.0 (tinker 0.22.0). Run in a child process by
test_mint_client.py; configuration comes from the environment (MINT_BASE_URL, MINT_API_KEY,
BASE_MODEL, LEARNING_RATE). Prints one JSON line of observations; any failed check raises.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import urllib.request

import mint  # noqa: F401  (applies the sk- key patch and MINT_* env before tinker clients exist)
import mint.mint as mintx
from mint import types

BASE = os.environ["BASE_MODEL"]
LR = float(os.environ.get("LEARNING_RATE", "0.1"))
assert mint.__tinker_version__ == "0.22.0", mint.__tinker_version__


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def main() -> dict:
    service = mint.ServiceClient()
    tc = service.create_lora_training_client(base_model=BASE, rank=4)
    batch = [datum([1, 2, 3, 4, 5, 6]), datum([7, 8, 9, 10])]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] < losses[0], losses
    fwd = tc.forward(batch, "cross_entropy").result()
    assert len(fwd.loss_fn_outputs) == 2

    state = tc.save_state("mint-state").result().path
    teacher = tc.save_weights_for_sampler("teacher").result().path
    sampler = service.create_sampling_client(model_path=teacher)
    sample = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(max_tokens=4)).result()
    assert len(sample.sequences) == 2 and all(len(s.tokens) <= 4 for s in sample.sequences)
    snap = tc.save_weights_and_get_sampling_client()
    assert snap.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result().sequences

    # Reverse KL against the teacher checkpoint, then an optimizer step on the student.
    def reverse_kl(reference: list[int]) -> mintx.ForwardBackwardReverseKLResponse:
        return mintx.forward_backward_reverse_kl(
            tc,
            reference_model_path=teacher,
            data=[
                mintx.ReverseKLDatum(
                    student_input=types.ModelInput.from_ints([1, 2, 3]),
                    reference_input=types.ModelInput.from_ints(reference),
                    target_tokens=types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3]),
                    weights=types.TensorData(data=[1.0, 1.0, 1.0], dtype="float32", shape=[3]),
                )
            ],
        )

    # The teacher was saved from the student's current weights, so on the same input the two are
    # one model: a KL of 0 shows the reference really is that checkpoint (not, say, the base).
    self_kl = reverse_kl([1, 2, 3])
    assert abs(self_kl.metrics["loss:sum"]) < 1e-5, self_kl
    rkl = reverse_kl([9, 1, 2, 3])
    assert len(rkl.outputs) == 1 and len(rkl.outputs[0].loss.data) == 3, rkl
    assert rkl.metrics["loss:sum"] > 0 and min(rkl.outputs[0].loss.data) >= 0, rkl
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()

    # Interpolate the teacher with a later sampler checkpoint, and sample from the result.
    later = tc.save_weights_for_sampler("later").result().path
    merged = mintx.interpolate_checkpoints(
        service, source_paths=[teacher, later], coefficients=[0.5, 0.5], output_path="merged"
    )
    assert merged.path.endswith("/sampler_weights/merged") and merged.checkpoint_type == "sampler", merged
    merged_sampler = service.create_sampling_client(model_path=merged.path)
    assert merged_sampler.sample(types.ModelInput.from_ints([4]), 1, types.SamplingParams(max_tokens=2)).result()
    # Interpolating one checkpoint with coefficient 1 reproduces it: same scores as the teacher.
    copy = mintx.interpolate_checkpoints(service, source_paths=[teacher], coefficients=[1.0], output_path="copy")
    probe = types.ModelInput.from_ints([1, 2, 3, 4, 5])
    copied = service.create_sampling_client(model_path=copy.path).compute_logprobs(probe).result()
    original = sampler.compute_logprobs(probe).result()
    assert max(abs(a - b) for a, b in zip(copied[1:], original[1:], strict=True)) < 1e-4, (copied, original)

    # REST, including the 0.22-only archive download.
    rest = service.create_rest_client()
    ids = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {"weights/mint-state", "sampler_weights/teacher", "sampler_weights/merged"} <= ids, ids
    url = rest.get_checkpoint_archive_url_from_tinker_path(teacher).result().url
    with urllib.request.urlopen(url) as resp:
        archive = resp.read()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        names = tar.getnames()
    assert "adapter_config.json" in names, names

    # Resume from the saved state in a new training client (0.22: weights_info + create + load).
    resumed = service.create_training_client_from_state(state)
    assert resumed.get_info().lora_rank == 4
    resumed.forward_backward(batch, "cross_entropy").result()
    return {
        "losses": losses, "rkl_metrics": rkl.metrics, "rkl_loss": list(rkl.outputs[0].loss.data),
        "self_kl": self_kl.metrics["loss:sum"], "archive": names, "state": state, "merged": merged.path,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
