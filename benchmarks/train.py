"""Training throughput of MinT's Trainer on SmolLM2-135M (a script, not a test).

Measures, each variant in a fresh subprocess (clean memory peaks, no shared caches):

1. single adapter, rank 16 on all targets, batch ROWS × SEQ tokens: tokens/s of our
   forward_backward + optim_step vs a plain transformers + PEFT loop doing the same forward,
   backward and torch.optim.AdamW; and our FLOP/s as a fraction of the measured fp32 matmul peak.
   FLOP model: 4·N per token, N = weights of every base matmul (q/k/v/o/gate/up/down in each layer,
   plus lm_head): 2·N forward + 2·N backward for the input gradients. The frozen base needs no
   weight-gradient GEMMs. LoRA and attention-score FLOPs are left out (stated in the output).
2. ADAPTERS adapters sharing the same ROWS × SEQ batch (ROWS / ADAPTERS rows each): one fused
   step (one Trainer.run over all of them, then their optim_steps) vs one run + optim_step per
   adapter in turn: wall-time ratio and peak-RSS ratio. A third variant fuses but keeps
   micro-batches at one adapter's size (max_tokens_per_pass), trading wall time for memory.

The Trainer runs with the engine's training-memory settings (`--checkpoint-from-tokens`,
`--logits-chunk-mb`; default `mint serve`'s own, which the SDK side gets too), so a batch over the
budget pays its block recomputation and logits chunks here as it does through the service.

Medians over --steps steps after --warmup (pooled over --rounds interleaved repeats); wall time
and process CPU time. First it prints the machine's measured read bandwidth and fp32 matmul peak;
a training step's floor is its FLOPs / that peak, and each step is also given as a multiple of it.
`--only ab` alternates ours (MINT_KERNELS=fast), ours with compiled blocks (`--compile auto`:
model/compiled_training.py), ours on the reference kernels and PEFT in one process: the
before/after ratios of the kernels and of the compiled blocks, measured side by side. Goals: ≥ 1.5× PEFT tokens/s,
≥ 75% of the matmul peak. The last stdout line is a JSON summary.

    python benchmarks/train.py [--model-dir DIR] [--steps 5] [--warmup 2] [--rounds 1] [--device cpu]
                               [--checkpoint-from-tokens 2048] [--logits-chunk-mb 128]
    python benchmarks/train.py --through sdk   # the same step via `mint serve` + the tinker SDK, vs PEFT
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def model_dir(arg: str | None) -> Path:
    from mint_server.model.prepare import default_model_dir, is_prepared, resolve_base_model

    if arg:
        return Path(arg)
    # The tests' cache (see tests/conftest.py) usually holds a prepared SmolLM2 already.
    test_cache = Path(os.environ.get("MINT_TEST_CACHE") or Path.home() / ".cache" / "mint-test")
    if is_prepared(default_model_dir(test_cache)):
        return default_model_dir(test_cache)
    return resolve_base_model(None)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# --- workers (each runs in its own process) -------------------------------------------------------


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(step, args) -> dict:
    """Wall and process-CPU seconds per step after warm-up. CPU time is the steadier figure on a
    shared machine: other processes stretch wall time, far less so the cycles this one used."""
    wall, cpu = [], []
    for _ in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        sync(args.device)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"step_s": wall[args.warmup :], "step_cpu_s": cpu[args.warmup :]}


def batch_tokens(args, vocab: int, seed: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, args.seq + 1), generator=g)


def worker_peak(args) -> dict:
    """Best fp32 GEMM rate over a few 2048³ multiplies: the denominator of the utilisation figure."""
    import torch

    n = 2048
    a = torch.randn(n, n, device=args.device)
    b = torch.randn(n, n, device=args.device)
    best = 0.0
    for _ in range(8):
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync(args.device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return {"peak_flops": best}


def worker_ours(args, build_only: bool = False):
    import torch
    from tinker import types

    from mint_server.engine.host_memory import keep_freed_memory
    from mint_server.engine.settings import EngineSettings
    from mint_server.model.loader import load_model
    from tests.engine.helpers import AdapterRegistry, TrainRequest
    from tests.engine.helpers import TrainerHarness as Trainer

    dtype = getattr(torch, args.dtype)
    if args.device == "cpu" and os.environ.get("MINT_KEEP_FREED_MEMORY") == "1":
        keep_freed_memory()  # as LocalEngine does with EngineSettings.keep_freed_memory (off by default)
    model = load_model(model_dir(args.model_dir), device=args.device, dtype=dtype)
    cfg = model.config
    n_adapters = 1 if args.variant == "ours" else args.adapters
    residency = AdapterRegistry(cfg, num_slots=n_adapters, max_rank=args.rank, device=args.device, dtype=dtype)
    # fused-microbatch: never more than one adapter's share of the batch in a forward pass
    budget = (args.rows // args.adapters) * args.seq if args.variant == "fused-microbatch" else None
    memory = EngineSettings(checkpoint_from_tokens=args.checkpoint_from_tokens, logits_chunk_mb=args.logits_chunk_mb)
    trainer = Trainer(model, residency, "bench", max_tokens_per_pass=budget,
                      checkpoint_from_tokens=memory.checkpoint_from_tokens or None,
                      logits_chunk=memory.logits_chunk_elements(), compile=args.compile)
    ids = [trainer.create_adapter(types.LoraConfig(rank=args.rank, seed=i)) for i in range(n_adapters)]
    if (warming := model.training_graph.warming) is not None:  # --compile auto: timed steps run compiled
        warming.join()
    rows_each = args.rows // n_adapters
    reqs = []
    for i, aid in enumerate(ids):
        seqs = batch_tokens(args, cfg.vocab_size, seed=i, rows=rows_each)
        datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                              loss_fn_inputs={"target_tokens": s[1:], "weights": torch.ones(args.seq)})
                  for s in seqs]
        reqs.append(TrainRequest(aid, datums, "cross_entropy"))
    adam = types.AdamParams(learning_rate=1e-4)
    setup_rss = rss_mb()

    def check(results) -> None:
        for r in results:
            if isinstance(r, Exception):
                raise r

    def fused() -> None:
        check(trainer.run(reqs))
        for aid in ids:
            trainer.optim_step(aid, adam)

    def sequential() -> None:
        for req in reqs:
            check(trainer.run([req]))
            trainer.optim_step(req.adapter_id, adam)  # type: ignore[arg-type]

    if build_only:
        fused.trainer = trainer  # type: ignore[attr-defined]  (its stats: compiled and eager passes)
        return fused
    times = timed(sequential if args.variant == "sequential" else fused, args)
    return {**times, "tokens_per_step": args.rows * args.seq, "setup_rss_mb": setup_rss, "peak_rss_mb": rss_mb(),
            **cuda_peak(args)}


def peft_step(args):
    """A plain transformers + PEFT training step (fwd, summed token NLL, bwd, AdamW) on ROWS × SEQ."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir(args.model_dir), dtype=dtype).to(args.device)
    pm = get_peft_model(hf, LoraConfig(r=args.rank, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    seqs = batch_tokens(args, hf.config.vocab_size, seed=0, rows=args.rows).to(args.device)
    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    def step() -> None:
        logits = pm(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def worker_peft(args) -> dict:
    step = peft_step(args)
    setup_rss = rss_mb()
    times = timed(step, args)
    return {**times, "tokens_per_step": args.rows * args.seq, "setup_rss_mb": setup_rss, "peak_rss_mb": rss_mb(),
            **cuda_peak(args)}


def cuda_peak(args) -> dict:
    import torch

    if not args.device.startswith("cuda"):
        return {}
    return {"peak_device_mb": torch.cuda.max_memory_allocated() / 2**20}


def worker_ab(args) -> dict:
    """Ours (fast kernels, eager), ours with compiled blocks (model/compiled_training.py; its
    compile falls in the warm-up steps), ours on the reference kernels and PEFT in one process,
    steps alternated: on a shared machine, slow spells then hit all alike, so their ratios stay
    meaningful even when absolute times do not."""
    from mint_server.model import kernels

    args.variant = "ours"
    args.compile = "off"
    ours = worker_ours(args, build_only=True)
    ours_ref_step = worker_ours(args, build_only=True)
    args.compile = "auto"
    ours_compiled = worker_ours(args, build_only=True)

    def ours_ref() -> None:
        with kernels.use("reference"):
            ours_ref_step()

    peft = peft_step(args)
    trio = [("ours", ours), ("ours_compiled", ours_compiled), ("ours_reference", ours_ref), ("peft", peft)]
    res: dict[str, dict] = {k: {"step_s": [], "step_cpu_s": []} for k, _ in trio}
    for i in range(args.warmup + args.steps):
        for name, step in trio[i % len(trio):] + trio[: i % len(trio)]:
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync(args.device)
            if i >= args.warmup:
                res[name]["step_s"].append(time.perf_counter() - t0)
                res[name]["step_cpu_s"].append(time.process_time() - c0)
    return {**res, "tokens_per_step": args.rows * args.seq, "compiled_trainer_stats": ours_compiled.trainer.stats}


def worker_sdk(args) -> dict:
    """The same training step as a user runs it: `mint serve` in its own process on loopback (its
    default engine sizes), the official tinker SDK here: forward_backward + optim_step of ROWS × SEQ
    tokens, rank RANK on every linear layer and the unembedding. Wall seconds per step (this
    process's CPU time is the client's, not the training's)."""
    import tempfile

    import tinker
    from tinker import types

    from tests.service.live import KEY_A, ServeProcess

    path = model_dir(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="mint-train-sdk-") as data, ServeProcess(
        "--base-model", str(path), "--data-dir", data, "--max-rank", str(max(args.rank, 32)), "--log-level", "warning",
        "--checkpoint-from-tokens", str(args.checkpoint_from_tokens), "--logits-chunk-mb", str(args.logits_chunk_mb),
        *(["--threads", str(args.threads)] if args.threads else []), *args.serve_args.split(),
    ) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=str(path), rank=args.rank, seed=0, train_unembed=True).result()
        from mint_server.model.config import ModelConfig

        vocab = ModelConfig.from_hf_dir(path).vocab_size
        seqs = batch_tokens(args, vocab, seed=0, rows=args.rows)
        data_ = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                             loss_fn_inputs={"target_tokens": s[1:].tolist(), "weights": [1.0] * args.seq})
                 for s in seqs]
        adam = types.AdamParams(learning_rate=1e-4)
        phases: dict[str, list[float]] = {"forward_backward_s": [], "optim_step_s": []}

        def step() -> None:
            t0 = time.perf_counter()
            fb = tc.forward_backward(data_, "cross_entropy")
            opt = tc.optim_step(adam)  # queued behind it, as the cookbook recipes do
            fb.result()
            t1 = time.perf_counter()
            opt.result()
            phases["forward_backward_s"].append(t1 - t0)
            phases["optim_step_s"].append(time.perf_counter() - t1)

        times = timed(step, args)
        client.close("success").result()
    return {**times, **{k: v[args.warmup:] for k, v in phases.items()}, "tokens_per_step": args.rows * args.seq}


WORKERS = {"ab": worker_ab, "sdk": worker_sdk, "peak": worker_peak, "ours": worker_ours, "peft": worker_peft, "fused": worker_ours,
           "fused-microbatch": worker_ours, "sequential": worker_ours}


# --- orchestration ----------------------------------------------------------------------------


def run_variants(variants: list[str], args) -> dict[str, dict]:
    """Each variant --rounds times, interleaved (A B C A B C …) so slow spells on a shared machine
    hit all of them; step times are pooled, peaks are the largest seen."""
    pooled: dict[str, dict] = {}
    for _ in range(args.rounds):
        for v in variants:
            r = spawn(v, args)
            p = pooled.setdefault(v, {**r, "step_s": [], "step_cpu_s": []})
            p["step_s"] += r.get("step_s", [])
            p["step_cpu_s"] += r.get("step_cpu_s", [])
            for k in ("peak_rss_mb", "setup_rss_mb", "peak_flops", "peak_device_mb"):
                if k in r:
                    p[k] = max(p[k], r[k])
    for p in pooled.values():
        if p["step_s"]:
            p["median_s"] = statistics.median(p["step_s"])
            p["median_cpu_s"] = statistics.median(p["step_cpu_s"])
    return pooled


def spawn(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--rows", str(args.rows), "--seq", str(args.seq), "--rank", str(args.rank),
           "--adapters", str(args.adapters), "--device", args.device, "--dtype", args.dtype,
           "--threads", str(args.threads), f"--serve-args={args.serve_args}",  # "=": the value may start with --
           "--checkpoint-from-tokens", str(args.checkpoint_from_tokens), "--logits-chunk-mb", str(args.logits_chunk_mb),
           "--compile", args.compile]
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    print(f"[{variant}] running…", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(f"[{variant}] {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def flop_model(path: Path) -> dict:
    from mint_server.model.config import ModelConfig
    from mint_server.model.lora import target_shapes

    cfg = ModelConfig.from_hf_dir(path)
    matmul_params = sum(layers * fi * fo for layers, fi, fo in target_shapes(cfg).values())
    attn = cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim  # per token per key position, fwd (QKᵀ + AV)
    return {"matmul_params": matmul_params, "flop_per_token": 4 * matmul_params,
            "excluded_attention_flop_per_token_fwd_at_seq": attn, "vocab": cfg.vocab_size}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's mint_server, benchmarks.*, tests.*
    from mint_server.engine.settings import EngineSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat each variant, interleaved")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads per worker (0: torch's default)")
    ap.add_argument("--worker", choices=sorted(WORKERS))
    ap.add_argument("--only", help="comma-separated subset of: single,fused,ab (ab: ours vs PEFT alternated "
                                   "in one process, for noisy machines; not in the default set)")
    ap.add_argument("--through", choices=["engine", "sdk"], default="engine",
                    help="sdk: the single-adapter step through `mint serve` and the tinker SDK, vs PEFT and the "
                         "engine directly, all in this run")
    ap.add_argument("--serve-args", default="", help="extra `mint serve` flags for the sdk side (one string)")
    ap.add_argument("--checkpoint-from-tokens", type=int, default=EngineSettings.checkpoint_from_tokens,
                    help="the Trainer's block-activation budget in padded tokens, as `mint serve` takes it "
                         "(0: never recompute; default: the engine's)")
    ap.add_argument("--compile", choices=["auto", "off"], default="off",
                    help="the Trainer's blocks compiled (auto) or eager (off); --only ab runs both side by side")
    ap.add_argument("--logits-chunk-mb", type=float, default=EngineSettings.logits_chunk_mb,
                    help="most fp32 logits materialised at once, as `mint serve` takes it (default: the engine's)")
    args = ap.parse_args()
    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        args.variant = args.worker
        print(json.dumps(WORKERS[args.worker](args)))
        return

    only = set((args.only or ("" if args.through == "sdk" else "single,fused")).split(","))
    from benchmarks.common import load_average, machine_floors

    floors = machine_floors(args.device)
    print(f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{floors['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s, load average {load_average()}", flush=True)
    summary: dict = {"read_gb_s": floors["read_bytes_per_s"] / 1e9,
                     "matmul_gflop_s": floors["matmul_flop_per_s"] / 1e9, "load_average_start": load_average(),
                     "device": args.device, "dtype": args.dtype, "threads": args.threads or _threads(), "rows": args.rows,
                     "seq": args.seq, "rank": args.rank, "steps": args.steps, "warmup": args.warmup,
                     "rounds": args.rounds, "checkpoint_from_tokens": args.checkpoint_from_tokens,
                     "logits_chunk_mb": args.logits_chunk_mb}
    if "single" in only:
        fm = flop_model(model_dir(args.model_dir))
        res = run_variants(["peak", "ours", "peft"], args)
        peak, ours, peft = res["peak"], res["ours"], res["peft"]
        tok_ours = ours["tokens_per_step"] / ours["median_s"]
        tok_peft = peft["tokens_per_step"] / peft["median_s"]
        attn_share = fm["excluded_attention_flop_per_token_fwd_at_seq"] * args.seq / 2 / (2 * fm["matmul_params"])
        summary["single"] = {
            "ours_tokens_per_s": tok_ours, "peft_tokens_per_s": tok_peft, "speedup_vs_peft": tok_ours / tok_peft,
            "ours_median_step_s": ours["median_s"], "peft_median_step_s": peft["median_s"],
            "speedup_vs_peft_cpu_time": peft["median_cpu_s"] / ours["median_cpu_s"],
            "flop_per_token": fm["flop_per_token"], "matmul_params": fm["matmul_params"],
            "peak_matmul_flops": peak["peak_flops"],
            "ours_fraction_of_peak": tok_ours * fm["flop_per_token"] / peak["peak_flops"],
            "ours_step_over_floor": peak["peak_flops"] / (tok_ours * fm["flop_per_token"]),
            "peft_fraction_of_peak": tok_peft * fm["flop_per_token"] / peak["peak_flops"],
            "attention_flops_left_out_vs_model": attn_share,
            "ours_peak_rss_mb": ours["peak_rss_mb"], "peft_peak_rss_mb": peft["peak_rss_mb"],
        }
    if args.through == "sdk":
        fm = flop_model(model_dir(args.model_dir))
        res = run_variants(["sdk", "ours", "peft"], args)
        sdk, ours, peft = res["sdk"], res["ours"], res["peft"]
        tokens = sdk["tokens_per_step"]
        floor_s = tokens * fm["flop_per_token"] / floors["matmul_flop_per_s"]
        summary["through_sdk"] = {
            "sdk_median_step_s": sdk["median_s"], "engine_median_step_s": ours["median_s"],
            "peft_median_step_s": peft["median_s"],
            "sdk_forward_backward_median_s": statistics.median(sdk["forward_backward_s"]),
            "sdk_optim_step_median_s": statistics.median(sdk["optim_step_s"]),
            "sdk_tokens_per_s": tokens / sdk["median_s"], "peft_tokens_per_s": tokens / peft["median_s"],
            "sdk_speedup_vs_peft": peft["median_s"] / sdk["median_s"],
            "engine_speedup_vs_peft": peft["median_s"] / ours["median_s"],
            "sdk_over_engine": sdk["median_s"] / ours["median_s"],
            "floor_s": floor_s, "sdk_fraction_of_peak": floor_s / sdk["median_s"],
        }
    if "ab" in only:
        res = spawn("ab", args)  # alternates internally; --rounds does not apply
        names = ("ours", "ours_compiled", "ours_reference", "peft")
        med = {k: {m: statistics.median(res[k][m]) for m in ("step_s", "step_cpu_s")} for k in names}
        fm = flop_model(model_dir(args.model_dir))
        floor_s = res["tokens_per_step"] * fm["flop_per_token"] / floors["matmul_flop_per_s"]
        summary["ab_interleaved"] = {
            "ours_median_step_s": med["ours"]["step_s"], "peft_median_step_s": med["peft"]["step_s"],
            "ours_reference_median_step_s": med["ours_reference"]["step_s"],
            "speedup_vs_peft": med["peft"]["step_s"] / med["ours"]["step_s"],
            "ours_compiled_median_step_s": med["ours_compiled"]["step_s"],
            "speedup_compiled_vs_peft": med["peft"]["step_s"] / med["ours_compiled"]["step_s"],
            "speedup_compiled_over_eager": med["ours"]["step_s"] / med["ours_compiled"]["step_s"],
            "ours_compiled_fraction_of_peak": floor_s / med["ours_compiled"]["step_s"],
            "speedup_reference_vs_peft": med["peft"]["step_s"] / med["ours_reference"]["step_s"],
            "speedup_fast_over_reference": med["ours_reference"]["step_s"] / med["ours"]["step_s"],
            "speedup_vs_peft_cpu_time": med["peft"]["step_cpu_s"] / med["ours"]["step_cpu_s"],
            "ours_tokens_per_s": res["tokens_per_step"] / med["ours"]["step_s"],
            "floor_s": floor_s, "ours_over_floor": med["ours"]["step_s"] / floor_s,
            "ours_fraction_of_peak": floor_s / med["ours"]["step_s"],
            "ours_reference_fraction_of_peak": floor_s / med["ours_reference"]["step_s"],
            "compiled_trainer_stats": res["compiled_trainer_stats"],
        }
    if "fused" in only:
        res = run_variants(["sequential", "fused", "fused-microbatch"], args)
        seq_, fused, micro = res["sequential"], res["fused"], res["fused-microbatch"]
        summary["fused"] = {
            "adapters": args.adapters, "rows_per_adapter": args.rows // args.adapters,
            "sequential_median_s": seq_["median_s"], "fused_median_s": fused["median_s"],
            "fused_microbatch_median_s": micro["median_s"],
            "wall_ratio": seq_["median_s"] / fused["median_s"],
            "wall_ratio_microbatch": seq_["median_s"] / micro["median_s"],
            "cpu_time_ratio": seq_["median_cpu_s"] / fused["median_cpu_s"],
            "sequential_peak_rss_mb": seq_["peak_rss_mb"], "fused_peak_rss_mb": fused["peak_rss_mb"],
            "fused_microbatch_peak_rss_mb": micro["peak_rss_mb"],
            "rss_ratio": fused["peak_rss_mb"] / seq_["peak_rss_mb"],
            "rss_ratio_microbatch": micro["peak_rss_mb"] / seq_["peak_rss_mb"],
            "setup_rss_mb": seq_["setup_rss_mb"],
        }
    summary["load_average_end"] = load_average()
    print(json.dumps(summary))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
