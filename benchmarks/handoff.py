"""Scale Down, handoff: optimizer step finished → the sampler serves the new weights (first token).

    python -m benchmarks.handoff [--models smollm2,qwen3-1.7b] [--repeats 3] [--quick]

For each model (each in its own subprocess, so one model's memory is gone before the next loads):

Adapter-only (MinT's path; the base stays resident, only the LoRA moves):
  - sdk_snapshot: through the real tinker SDK against the app on loopback, after
    `optim_step(...).result()` returns: `save_weights_and_get_sampling_client()` (the default
    kind: the server exports the adapter as a PEFT dir, the sampler's residency manager loads it)
    then `sample(max_tokens=1)` on it. The headline adapter figure.
  - sdk_inflight: the same with `kind="inflight"` (the sampler reads the training slot: no copy).
    For both, the publish call's own time is reported too (the rest is the first sample).
  - engine_snapshot: the same publish one layer down, without HTTP: `engine.export_peft` to a
    dir, then `engine.submit(prepare_sample(AdapterSource(dir), …))`.
Merged checkpoint (what a TRL + vLLM user does after each step):
  - merge the LoRA into the base weights in place (W += alpha/r · B·A per target and layer: PEFT's
    `merge_and_unload` math, on the base state dict the trainer holds in memory), write
    safetensors + config + tokenizer (no fsync, as `save_pretrained`), load a fresh sampler on the
    dir and sample one token. The fresh sampler is our own engine loading the HF dir in this
    process: a stand-in for starting a fresh vLLM process that leaves out process start, CUDA
    init and graph capture, so it flatters the merged path.
Untimed setup on the merged side: reading the base weights into memory (the trainer already holds
them) and getting the trained LoRA out of our engine (a TRL trainer holds it in memory too).

Models: the prepared SmolLM2-135M (fp32 on disk, fp32 engine), and a 1.7B-parameter Qwen3-shaped
checkpoint (Qwen3-1.7B's sizes, tied embeddings, random bf16 weights written to a temp dir by this
script and deleted after; the engine runs it in bf16 to keep one copy at ~3.4 GB). --quick: a tiny
random Qwen3 instead, one repeat (a smoke run). LoRA: rank 16 on attention and MLP (no unembed,
so the merged checkpoint keeps tied embeddings and the base's size: the conservative choice).
Next to the figures: the disk's write+fsync and cold-read bandwidth on a file of the checkpoint's
size, and the adapter's vs checkpoint's bytes. Medians over --repeats (after one warm-up round);
the ratio merged / adapter per model (MinT's goal: ≥ 18.3×). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK = 16
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
MODELS = ("smollm2", "qwen3-1.7b", "tiny")
# Qwen3-1.7B's published sizes (tied embeddings): 1.72e9 parameters.
QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip


# --- checkpoints --------------------------------------------------------------------------------


def word_tokenizer(dest: Path, vocab_size: int) -> None:
    """A word-level tokenizer naming every id of the vocab (t0 … tN), so any sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0")
    fast.save_pretrained(dest)


def make_qwen3_1p7b(dest: Path, shard_bytes: int = 1 << 30, sizes: dict | None = None) -> Path:
    """Random bf16 weights in Qwen3-1.7B's shapes (or `sizes`), written shard by shard (≤ shard_bytes
    in memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**(sizes or QWEN3_1P7B), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.torch_dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    dest.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    names = list(shapes)

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for k in names:
        if k.endswith("norm.weight"):
            shard[k] = torch.ones(shapes[k], dtype=torch.bfloat16)
        else:
            shard[k] = (torch.randn(shapes[k], generator=g) * 0.02).to(torch.bfloat16)
        if sum(t.numel() * 2 for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(dest)
    word_tokenizer(dest, cfg.vocab_size)
    return dest


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


# --- the machine's disk -------------------------------------------------------------------------


def disk_bandwidth(directory: Path, size: int, chunk: int = 64 << 20) -> dict[str, float]:
    """Write+fsync a `size`-byte file, drop it from the page cache, read it back: bytes/s each way."""
    path = directory / "bandwidth.bin"
    block = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < size:
            written += f.write(block[: min(chunk, size - written)])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages after fsync: evicted, so a cold read
    t0 = time.perf_counter()
    while os.read(fd, chunk):
        pass
    read_s = time.perf_counter() - t0
    os.close(fd)
    path.unlink()
    return {"disk_write_fsync_gb_s": size / write_s / 1e9, "disk_cold_read_gb_s": size / read_s / 1e9,
            "disk_test_bytes": size}


# --- one model (runs in its own process) --------------------------------------------------------


def engine_settings():
    from mint_server.engine.settings import EngineSettings

    # Small KV pool: one short prompt at a time; the same for the resident and the fresh sampler.
    return EngineSettings(device_slots=4, max_rank=RANK, kv_budget_tokens=1024, max_context=512)


def train_batch():
    from tinker import types

    seq = [5, 17, 33, 60, 61, 62, 63, 9, 10, 11, 12, 13, 14, 15, 16, 20, 21]
    return [types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})]


def sample_params(max_tokens: int = 1):
    from tinker import types

    return types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[])


def read_base_state(model_dir: Path) -> dict:
    """The base weights as a trainer holds them: HF names, the checkpoint's own dtype, in memory."""
    from safetensors import safe_open

    from mint_server.model.loader import weight_files

    state = {}
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():
                # clone: get_tensor's storage may map the file, and writing to it in the merge would
                # fault page by page; a trainer's weights are ordinary memory
                state[k] = sf.get_tensor(k).clone()
    return state


def merge_into(state: dict, lora, cfg) -> None:
    """PEFT's merge in place: W += (alpha / r) · B @ A for every target of every layer (fp32 math)."""
    import torch

    from mint_server.model.peft_io import peft_key

    scale = lora.alpha / lora.rank
    for target, (a, b) in lora.weights.items():
        for layer in range(a.shape[0]):
            name = peft_key(target, layer, "A").removeprefix("base_model.model.").replace(".lora_A", "")
            w = state[name]
            if w.dtype == torch.float32:
                w.addmm_(b[layer], a[layer], alpha=scale)  # in place: no temporary the size of W
            else:  # low-precision weights: the product in fp32, rounded once into W
                w.add_(torch.mm(b[layer].float(), a[layer].float()), alpha=scale)


def write_checkpoint(state: dict, base_dir: Path, dest: Path) -> None:
    """What save_pretrained leaves: weights, config, tokenizer files (no fsync)."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for f in base_dir.iterdir():  # config, generation config, tokenizer files
        if f.is_file() and not f.name.startswith("model") and f.suffix in (".json", ".txt", ".model", ".jinja"):
            shutil.copy2(f, dest / f.name)


def first_token(engine, adapter) -> int:
    res = engine.submit(engine.prepare_sample(adapter, PROMPT, 1, sample_params())).result()
    return res.sequences[0].tokens[0]


def run_model(which: str, repeats: int, work: Path) -> dict:
    import tinker
    import torch
    from tinker import types

    from mint_server.engine.local import LocalEngine
    from mint_server.engine.values import AdapterSource
    from mint_server.model.config import ModelConfig
    from mint_server.model.peft_io import load_peft
    from tests.service.live import KEY_A, LiveServer

    t0 = time.perf_counter()
    if which == "smollm2":
        from benchmarks.common import smollm2_dir
        from mint_server.model.prepare import DEFAULT_BASE_MODEL

        model_dir, base, dtype = smollm2_dir(), DEFAULT_BASE_MODEL, torch.float32
    elif which == "qwen3-1.7b":
        model_dir, base, dtype = make_qwen3_1p7b(work / "qwen3-1.7b"), "bench/qwen3-1.7b", torch.bfloat16
    else:
        from tests.tiny import make_tiny_checkpoint

        model_dir, base, dtype = make_tiny_checkpoint(work / "tiny", family="qwen3"), "tiny/qwen3", torch.float32
    make_s = time.perf_counter() - t0
    cfg = ModelConfig.from_hf_dir(model_dir)
    ckpt_bytes = checkpoint_bytes(model_dir)
    print(f"[{which}] checkpoint {ckpt_bytes / 1e9:.2f} GB ({make_s:.0f} s to make/find); measuring disk", file=sys.stderr,
          flush=True)
    result: dict = {"model": which, "params": None, "engine_dtype": str(dtype).removeprefix("torch."),
                    "checkpoint_bytes": ckpt_bytes, **disk_bandwidth(work, ckpt_bytes)}
    lora = types.LoraConfig(rank=RANK, seed=0, train_unembed=False)
    adam = types.AdamParams(learning_rate=1e-2)
    params = sample_params()
    prompt = types.ModelInput.from_ints(PROMPT)

    # --- adapter-only: the resident engine behind the app on loopback ---------------------------
    engine = LocalEngine(model_dir, base_model=base, dtype=dtype, settings=engine_settings())
    result["params"] = sum(p.numel() for p in engine.model.parameters())
    server = LiveServer(engine, work / "data").start()
    timings: dict[str, list[float]] = {"sdk_snapshot": [], "sdk_inflight": [], "engine_snapshot": []}
    publish: dict[str, list[float]] = {"sdk_snapshot": [], "sdk_inflight": []}  # the SDK call alone
    try:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=base, rank=RANK, seed=0, train_unembed=False).result()
        aid = engine.create_adapter(lora).result()
        data = train_batch()

        def step_sdk() -> None:
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(adam).result()

        def step_engine() -> None:
            engine.submit(engine.prepare_train(data, "cross_entropy", None).on(aid)).result()
            engine.submit(engine.prepare_optim(adam).on(aid)).result()

        def sdk(kind: str) -> float:
            step_sdk()
            t = time.perf_counter()  # the optimizer step has finished
            sc = tc.save_weights_and_get_sampling_client(kind=kind).result()
            publish[f"sdk_{kind}"].append(time.perf_counter() - t)
            sc.sample(prompt, 1, params).result()
            return time.perf_counter() - t

        def engine_snapshot(i: int) -> float:
            step_engine()
            dest = work / f"snap-{i}"
            t = time.perf_counter()
            engine.export_peft(aid, dest).result()
            first_token(engine, AdapterSource(f"bench:snap-{i}", peft_dir=dest))
            return time.perf_counter() - t

        for i in range(repeats + 1):  # round 0 warms up every path
            for name, fn in (("sdk_snapshot", lambda: sdk("snapshot")), ("sdk_inflight", lambda: sdk("inflight")),
                             ("engine_snapshot", lambda i=i: engine_snapshot(i))):
                s = fn()
                if i:
                    timings[name].append(s)
            print(f"[{which}] adapter round {i}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in timings.items() if v),
                  file=sys.stderr, flush=True)
        adapter_dir = work / "trained-adapter"
        engine.export_peft(aid, adapter_dir).result()
        adapter_bytes = (adapter_dir / "adapter_model.safetensors").stat().st_size
        adapter_token = first_token(engine, aid)
        client.close("success")
    finally:
        server.stop()
        engine.shutdown()
    engine = server = None  # drop the resident model before the merged side loads its own
    gc.collect()

    # --- merged checkpoint: merge, write, fresh sampler, first token -----------------------------
    trained = load_peft(adapter_dir, cfg)
    merged_s: list[float] = []
    merged_token = None
    phases: dict[str, list[float]] = {"merge": [], "write": [], "load": [], "first_token": []}
    for i in range(repeats + 1):
        state = read_base_state(model_dir)  # untimed: the trainer holds the base in memory
        dest = work / f"merged-{i}"
        marks = [time.perf_counter()]
        merge_into(state, trained, cfg)
        marks.append(time.perf_counter())
        write_checkpoint(state, model_dir, dest)
        marks.append(time.perf_counter())
        del state
        gc.collect()
        fresh = LocalEngine(dest, base_model=base, dtype=dtype, settings=engine_settings())
        marks.append(time.perf_counter())
        merged_token = first_token(fresh, None)
        marks.append(time.perf_counter())
        fresh.shutdown()
        del fresh
        gc.collect()
        merged_bytes = checkpoint_bytes(dest)
        shutil.rmtree(dest)
        if i:
            merged_s.append(marks[-1] - marks[0])
            for k, a, b in zip(phases, marks, marks[1:], strict=False):
                phases[k].append(b - a)
        print(f"[{which}] merged round {i}: {marks[-1] - marks[0]:.3f}s", file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in timings.items()}
    merged = statistics.median(merged_s)
    result.update({
        **{f"adapter_{k}_s": v for k, v in med.items()},
        # the save_weights_and_get_sampling_client call alone (the rest: the first sample)
        **{f"adapter_{k}_publish_s": statistics.median(v[1:]) for k, v in publish.items()},
        "merged_s": merged, **{f"merged_{k}_s": statistics.median(v) for k, v in phases.items()},
        "ratio": merged / med["sdk_snapshot"],
        "ratio_sdk_inflight": merged / med["sdk_inflight"],
        "ratio_engine_snapshot": merged / med["engine_snapshot"],
        "adapter_bytes": adapter_bytes, "merged_checkpoint_bytes": merged_bytes,
        "bytes_ratio": merged_bytes / adapter_bytes,
        "first_token_agrees": adapter_token == merged_token,
        "all_s": {**timings, "merged": merged_s},
    })
    return result


# --- orchestration ------------------------------------------------------------------------------


def spawn(which: str, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.handoff", "--worker", which, "--repeats", str(repeats)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,qwen3-1.7b", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny random Qwen3, one repeat (smoke run)")
    ap.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory(prefix="mint-handoff-") as work:
            print(json.dumps(run_model(args.worker, args.repeats, Path(work))))
        return

    from benchmarks.common import load_average

    models = ["tiny"] if args.quick else args.models.split(",")
    repeats = 1 if args.quick else args.repeats
    summary: dict = {"load_average_start": load_average(), "repeats": repeats, "rank": RANK, "goal_ratio": 18.3}
    for which in models:
        if which not in MODELS:
            ap.error(f"--models: unknown {which!r}")
        r = spawn(which, repeats)
        summary[which] = r
        print(f"{which}: adapter (SDK snapshot) {r['adapter_sdk_snapshot_s']:.3f}s, inflight "
              f"{r['adapter_sdk_inflight_s']:.3f}s, engine snapshot {r['adapter_engine_snapshot_s']:.3f}s | merged "
              f"{r['merged_s']:.3f}s (merge {r['merged_merge_s']:.2f}, write {r['merged_write_s']:.2f}, load "
              f"{r['merged_load_s']:.2f}, token {r['merged_first_token_s']:.2f}) | ratio {r['ratio']:.1f}x "
              f"(goal >= 18.3x) | disk write+fsync {r['disk_write_fsync_gb_s']:.2f} GB/s, cold read "
              f"{r['disk_cold_read_gb_s']:.2f} GB/s | adapter {r['adapter_bytes'] / 1e6:.1f} MB vs checkpoint "
              f"{r['merged_checkpoint_bytes'] / 1e6:.0f} MB", flush=True)
    summary["load_average_end"] = load_average()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
