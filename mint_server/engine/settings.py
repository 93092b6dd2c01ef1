"""The engine's one home for sizes and limits.

`EngineSettings` is what an operator chooses (the `mint serve` flags are generated from its fields
and defaults); `EngineLimits` is what follows for clients once a model is loaded (the largest rank,
context, sample count …). The CLI, the API's checks, the engine's own parsing and the advertised
capabilities all read these two objects, so a rule is written once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from mint_server.engine.scheduler import StepCost

# Values of EngineSettings.quantize: the base's weight precision after load.
QUANTIZE_CHOICES = ("none", "int8", "int4")


@dataclass(frozen=True)
class EngineSettings:
    # Residency: device slots are the LoRA bank (what one step can read); the host cache holds
    # decoded adapters (and training state) that are not in a slot; everything else is in the store.
    device_slots: int = 16
    host_cache_mb: float = 2048.0
    max_rank: int = 32
    # KV cache: a pool of this many token positions shared by all running sequences.
    kv_budget_tokens: int = 65536
    # KV cache in MiB instead: the pool holds this many bytes of the model's own cache entries, so a
    # base whose entry is small (MLA's latent cache) holds more positions. Overrides kv_budget_tokens.
    kv_budget_mb: float | None = None
    # Longest sequence, for training and sampling alike; None: the model's own context.
    max_context: int | None = None
    # Decode rows one engine step may run, and its tokens when no prompt chunk is in it (engine/scheduler.py).
    # It bounds how long new work waits for the step in flight; None: step_tokens_for(the measured cost) below.
    max_step_tokens: int | None = None
    # Tokens a step may run when prompt chunks are in it (at least max_step_tokens): one chunk yields one
    # row's logits and draw, so prompt tokens reach their best throughput in bigger steps than decode
    # rows do (SmolLM2 on 2 CPU cores: 379 prompt tokens/s in chunks of 128, 442 in chunks of 256).
    # None: measured at start-up (Sampler.measure_chunk_tokens).
    max_chunk_tokens: int | None = None
    # Fair shares (engine/scheduler.py): while a key that is served less than the busiest one has rows
    # in a step, the step is sized so that it costs at most max_slowdown × what that key's own rows
    # alone would cost (a quiet key's request then takes at most about max_slowdown × its idle time,
    # plus the wait for the step in flight when it arrives). Step cost is measured at start-up (the
    # cost of a step by its tokens, StepCost), or modelled as step_overhead_tokens + tokens if set.
    max_slowdown: float = 1.25
    # A key protected so (a light one) stays protected this many seconds after its work ends: a
    # closed-loop client's next request (a chat turn, an SDK loop) is on its way and would otherwise
    # arrive to find a full step of the heavy key's in flight. 0: no lingering.
    linger_s: float = 0.2
    step_overhead_tokens: int | None = None
    # Training beside serving: a forward_backward runs in slices of at most this many padded tokens
    # (gradient accumulation: the result equals one pass) while sampling work waits, and the sampler
    # gets sample_steps_per_slice steps between two slices.
    train_slice_tokens: int = 512
    sample_steps_per_slice: int = 4
    # Padded tokens in one fused training pass (more are split into micro-batches).
    max_fused_tokens: int = 32768
    # Training memory. A fused pass never holds more than its largest request would alone (it
    # recomputes blocks and chunks its logits to that size: Trainer.memory_plan); a request alone
    # runs at full speed up to these bounds. Block activations a pass keeps, in padded tokens: a pass
    # of T > B tokens recomputes its first ceil((1 - B/T) x layers) blocks in backward (activation
    # checkpointing, that share of one more forward); 0: no bound. (docs/training-speed.md)
    checkpoint_from_tokens: int = 2048
    # The most fp32 logits a training pass materialises at once (MiB); above it the lm_head and
    # log-softmax run in position chunks, recomputed in backward. The log-softmax and its backward
    # run in the logits' own buffer, so this is the logits stage's whole peak (an 8 x 256 SmolLM2
    # batch's 402 MB fit; chunked at 128 its step is ~9% slower).
    logits_chunk_mb: float = 512.0
    max_num_samples: int = 128
    # Alternatives reported per sampled token (OpenAI's top_logprobs; each costs a top-k per step).
    max_top_logprobs: int = 20
    max_batch_rows: int = 256  # running sequences at once
    records_ttl_s: float = 3600.0
    loader_threads: int = 2
    # Niceness the loader threads add to the process's own (Linux; 0: none). A burst of cold loads
    # reads and decodes on the cores the engine's steps run on; at equal priority it takes their
    # share of the CPU and every running stream slows, while loads only need to land a step ahead.
    loader_nice: int = 10
    # Bytes copied host → device slots between two steps (at least one adapter per step).
    load_bytes_per_step: int = 256 * 1024 * 1024
    # Where paged-out training state lives; None: a private temporary dir.
    store_dir: Path | None = None
    # Intra-op threads of the engine's tensor math; None: the cores this process may run on.
    threads: int | None = None
    # On a CPU device, keep freed host memory for the next step instead of returning it to the kernel
    # (engine/host_memory.py: no page faults on every step's big blocks; RSS stays at its peak, and
    # varied block sizes fragment the heap, so it is opt-in).
    keep_freed_memory: bool = False
    # Tensor-parallel ranks of the engine's model (1: one process). Rank 0 is the server process and
    # schedules; ranks 1..tp-1 are spawned processes that run its tensor work on their share
    # (engine/tp_runner.py). gloo on CPU, NCCL on CUDA (one GPU per rank).
    tp: int = 1
    # Seconds a tensor-parallel collective may wait for its peers: a rank that is alive but stuck
    # (hung kernel, stopped process) fails the op it holds with EngineFailed after this, instead of
    # rank 0 waiting forever. Idle ranks wait for their next op without a limit.
    tp_timeout_s: float = 300.0
    # Batch-invariant numerics (model/invariant.py): a row's logits, logprobs, sampled tokens and
    # gradients are bitwise the same whatever else is in its batch, and the sampler's logprobs equal
    # the training forward's. Dense families on one rank; costs padding and smaller kernels.
    batch_invariant: bool = False
    # The decode step as compiled graphs (model/compiled.py): "auto" compiles in the background after
    # start-up (steps run eagerly meanwhile) where the family and device allow, "off" stays eager.
    # MINT_COMPILE sets the default (the test suite runs eager unless a test asks).
    compile: str = field(default_factory=lambda: os.environ.get("MINT_COMPILE", "auto"))
    # Keep full KV blocks of earlier requests for later ones with the same prefix (a chat's next turn,
    # a multi-turn environment's next step): keyed by base, adapter revision, owner and tokens, evicted
    # least recently used when the pool needs the room (engine/kv.py, docs/engine.md "Prefix cache").
    # Off by itself on hybrid (linear-attention) and vision bases.
    prefix_cache: bool = True
    # Where inductor keeps compiled kernels and graphs (a restart then compiles warm); None: its own default.
    compile_cache_dir: Path | None = None
    # Weight-only quantization of the frozen base at load (model/quantize.py, docs/quantization.md):
    # "int8" (per-channel) or "int4" (grouped); LoRA adapters train and serve on top in full precision
    # (QLoRA). A decode step reads a quarter (int8) or about an eighth (int4) of the base's fp32 bytes.
    quantize: str = "none"

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        positive = ("device_slots", "max_rank", "kv_budget_tokens", "max_fused_tokens",
                    "max_num_samples", "max_batch_rows", "loader_threads", "load_bytes_per_step", "tp",
                    "train_slice_tokens", "sample_steps_per_slice")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.max_slowdown, int | float) and math.isfinite(self.max_slowdown)
                and self.max_slowdown >= 1):
            raise ValueError(f"max_slowdown must be a number >= 1, got {self.max_slowdown!r}")
        if not (isinstance(self.linger_s, int | float) and math.isfinite(self.linger_s) and self.linger_s >= 0):
            raise ValueError(f"linger_s must be a number of seconds >= 0, got {self.linger_s!r}")
        if self.max_step_tokens is not None and (not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 1):
            raise ValueError(f"max_step_tokens must be a positive integer, got {self.max_step_tokens!r}")
        if self.max_chunk_tokens is not None and (not isinstance(self.max_chunk_tokens, int) or self.max_chunk_tokens < 1):
            raise ValueError(f"max_chunk_tokens must be a positive integer, got {self.max_chunk_tokens!r}")
        if self.step_overhead_tokens is not None and (
                not isinstance(self.step_overhead_tokens, int) or self.step_overhead_tokens < 0):
            raise ValueError(f"step_overhead_tokens must be an integer >= 0, got {self.step_overhead_tokens!r}")
        if not isinstance(self.loader_nice, int) or not 0 <= self.loader_nice <= 19:
            raise ValueError(f"loader_nice must be an integer in 0..19, got {self.loader_nice!r}")
        if not isinstance(self.max_top_logprobs, int) or self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs must be an integer >= 0, got {self.max_top_logprobs!r}")
        if not (isinstance(self.tp_timeout_s, int | float) and math.isfinite(self.tp_timeout_s)
                and self.tp_timeout_s > 0):
            raise ValueError(f"tp_timeout_s must be a number > 0, got {self.tp_timeout_s!r}")
        if not isinstance(self.host_cache_mb, int | float) or not self.host_cache_mb >= 0:
            raise ValueError(f"host_cache_mb must be >= 0, got {self.host_cache_mb!r}")
        if self.kv_budget_mb is not None and not (isinstance(self.kv_budget_mb, int | float) and self.kv_budget_mb > 0):
            raise ValueError(f"kv_budget_mb must be > 0, got {self.kv_budget_mb!r}")
        if not isinstance(self.checkpoint_from_tokens, int) or self.checkpoint_from_tokens < 0:
            raise ValueError(f"checkpoint_from_tokens must be an integer >= 0, got {self.checkpoint_from_tokens!r}")
        if not (isinstance(self.logits_chunk_mb, int | float) and self.logits_chunk_mb > 0):
            raise ValueError(f"logits_chunk_mb must be > 0, got {self.logits_chunk_mb!r}")
        for name in ("batch_invariant", "keep_freed_memory", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.batch_invariant and self.tp != 1:
            raise ValueError("batch_invariant is supported on one rank only (tp=1)")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        if self.quantize != "none" and (self.tp != 1 or self.batch_invariant):
            # the quantized products are neither split over ranks nor batch-invariant (model/quantize.py)
            raise ValueError(f"quantize {self.quantize} is supported on one rank (tp=1) without batch_invariant")
        if self.compile not in ("auto", "off"):
            raise ValueError(f"compile must be auto or off, got {self.compile!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context!r}")
        if not (isinstance(self.records_ttl_s, int | float) and math.isfinite(self.records_ttl_s)
                and self.records_ttl_s > 0):
            raise ValueError(f"records_ttl_s must be > 0, got {self.records_ttl_s!r}")

    def kv_tokens(self, bytes_per_token: int) -> int:
        """The KV pool in token positions, for a model whose cache costs bytes_per_token per position."""
        if self.kv_budget_mb is None:
            return self.kv_budget_tokens
        return max(1, int(self.kv_budget_mb * 2**20) // bytes_per_token)

    def step_tokens(self, overhead_tokens: int) -> int:
        """max_step_tokens, or, for a cost model of step_overhead_tokens + tokens, 4 × (overhead + 1)
        within 128..8192: a full step then costs about 4 empty ones."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return min(8192, max(128, 4 * (overhead_tokens + 1)))

    def step_tokens_for(self, cost: StepCost) -> int:
        """max_step_tokens, or by default from the measured cost curve: the fewest tokens per step that
        reach 90 % of the best measured throughput (bigger steps gain little, and work arriving
        mid-step waits the step out), within 16..8192. Where throughput still grows at the largest
        size measured (an accelerator), 4 × one token's step, as step_tokens does."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        chosen = cost.saturation(0.9)
        if chosen == cost.tokens[-1]:
            chosen = max(chosen, 4 * (round(cost.at(1)) + 1))
        return min(8192, max(16, chosen))

    def intra_op_threads(self) -> int:
        """threads, or the cores given to this process (its CPU affinity) when unset, shared by the
        tensor-parallel ranks."""
        if self.threads is not None:
            return self.threads
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        return max(1, cores // self.tp)

    def logits_chunk_elements(self) -> int:
        """logits_chunk_mb as fp32 logits elements (the Trainer's logits_chunk)."""
        return max(1, int(self.logits_chunk_mb * 2**20) // 4)


@dataclass(frozen=True)
class EngineLimits:
    """What a client may ask of this engine; every check and the advertised capabilities read it."""

    base_model: str
    arch: str
    vocab_size: int
    max_context: int  # prompt + completion when sampling; datum length when training
    max_rank: int
    max_num_samples: int
    max_top_k: int  # = vocab_size; -1 means "no limit"
    loss_fns: frozenset[str]
    max_top_logprobs: int = 20  # alternatives per sampled token (0: none)
    max_stop_sequences: int = 16  # stop strings or stop token ids per request (OpenAI's own bound is 4)
    max_stop_chars: int = 256  # per stop string
    # Image input (vision-language bases): the token ids an image is written with — vision start, the
    # image placeholder (one per image token), vision end; None: the base reads tokens only.
    image_tokens: tuple[int, int, int] | None = None
    max_logit_bias: int = 1024  # tokens one request's logit_bias may name
    max_grammar_chars: int = 65536  # a response_format (its JSON) — a JSON schema, regex or grammar

    @classmethod
    def of(cls, settings: EngineSettings, *, base_model: str, arch: str, vocab_size: int, model_context: int,
           loss_fns: frozenset[str], image_tokens: tuple[int, int, int] | None = None) -> EngineLimits:
        context = min(model_context, settings.max_context or model_context)
        return cls(base_model=base_model, arch=arch, vocab_size=vocab_size, max_context=context,
                   max_rank=settings.max_rank, max_num_samples=settings.max_num_samples, max_top_k=vocab_size,
                   loss_fns=loss_fns, max_top_logprobs=min(settings.max_top_logprobs, vocab_size),
                   image_tokens=image_tokens)


@dataclass(frozen=True)
class FleetSettings:
    """A fleet of engine replicas on Ray (`mint serve --ray`); each replica gets the EngineSettings."""

    replicas: int = 2
    ray_address: str | None = None  # None: start a local Ray instance; "auto" or host:port: join one
    cpus_per_replica: float = 1.0  # Ray CPUs reserved per replica (and its torch threads, at least 1)
    gpus_per_replica: float = 0.0
    # Sample requests in flight on a replica beyond which new ones for a policy homed there spill to
    # the least-loaded replica (so a hot policy is served by several).
    spill_inflight: int = 64
    max_restarts: int = -1  # Ray restarts a dead replica this many times (-1: always)
    sample_retries: int = 3  # re-dispatches of a sample request whose replica died under it
    pin_cores: bool = False  # pin replica i to core i (benchmarks: one core per replica)
    local_object_store_mb: int = 256  # object store of a Ray instance the fleet starts itself

    def check(self) -> None:
        for name in ("replicas", "spill_inflight"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.cpus_per_replica > 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica!r}")
        if not isinstance(self.sample_retries, int) or self.sample_retries < 0:
            raise ValueError(f"sample_retries must be >= 0, got {self.sample_retries!r}")
