"""The engine's one home for sizes and limits.

`EngineSettings` is what an operator chooses (the `mint serve` flags are generated from its fields
and defaults); `EngineLimits` is what follows for clients once a model is loaded (the largest rank,
context, sample count …). The CLI, the API's checks, the engine's own parsing and the advertised
capabilities all read these two objects, so a rule is written once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from mint_server.engine.scheduler import StepCost

# Values of EngineSettings.quantize: the base's weight precision after load.
QUANTIZE_CHOICES = ("none", "int8", "int4")


def setting(default: Any = MISSING, *, help: str, flag: str | None = "", default_text: str | None = None,
            doc: str = "", advertise: bool = False, deprecated_flags: tuple[str, ...] = (),
            default_factory: Callable[[], Any] | None = None) -> Any:
    """An EngineSettings field with what is said of it everywhere: `help` (the `mint serve` flag's help
    and the docs table's meaning; no square brackets, which rich reads as markup), `flag` ("": --name
    spelled with dashes; None: not a flag), `default_text` (the default in words where the value
    alone does not say it), `doc` (more for the docs table only), `advertise` (listed in
    /api/v1/get_server_capabilities) and `deprecated_flags` (old spellings still accepted)."""
    metadata = {"help": help, "flag": flag, "default_text": default_text, "doc": doc, "advertise": advertise,
                "deprecated_flags": deprecated_flags}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)



class InvalidSetting(ValueError):
    """A setting out of range: `field` names it (the CLI shows its flag), the text says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field, self.reason = field, reason

@dataclass(frozen=True)
class EngineSettings:
    # Residency: device slots are the LoRA bank (what one step can read); the host cache holds
    # decoded adapters (and training state) that are not in a slot; everything else is in the store.
    device_slots: int = setting(
        16, deprecated_flags=("--adapter-slots",),
        help="LoRA adapters in device slots at once (training + sampling): what one step can read; more adapters "
        "wait in the host cache and the store and are paged in as needed.")
    host_cache_mb: float = setting(
        2048.0, help="Host memory for adapters not in a slot (weights, fp32 masters, AdamW moments, pending "
        "gradients), MiB; beyond it they are paged to the store.")
    max_rank: int = setting(32, advertise=True, help="Largest LoRA rank a client may ask for.")
    kv_budget_tokens: int = setting(
        65536, help="KV cache size in token positions shared by running sequences.",
        doc="SmolLM2 fp32: about 2.8 GiB.")
    # The pool holds this many bytes of the model's own cache entries, so a base whose entry is small
    # (MLA's latent cache) holds more positions. Overrides kv_budget_tokens.
    kv_budget_mb: float | None = setting(
        None, help="KV cache size in MiB instead of positions: the pool holds as many positions as the model's "
        "cache entries fit (MLA's latent cache: several times more than full K/V).")
    max_context: int | None = setting(
        None, flag="--max-seq-len", default_text="the model's context", advertise=True,
        help="Longest sequence, for training and sampling alike: a training datum, or prompt + max_tokens.")
    # Decode rows one engine step may run, and its tokens when no prompt chunk is in it (engine/scheduler.py).
    # It bounds how long new work waits for the step in flight.
    max_step_tokens: int | None = setting(
        None, default_text="the fewest that reach 90% of the measured best throughput, within 16..8192",
        help="Decode rows one engine step may run, and its tokens in all when no prompt chunk is in it; new "
        "work waits at most one step.",
        doc="Measured at start-up (SmolLM2 on this project's 2 CPU cores: 64-128).")
    # One chunk yields one row's logits and draw, so prompt tokens reach their best throughput in bigger
    # steps than decode rows do (SmolLM2 on 2 CPU cores: 379 prompt tokens/s in chunks of 128, 442 in
    # chunks of 256). Measured at start-up by step_costs.measure_chunk_tokens.
    max_chunk_tokens: int | None = setting(
        None, default_text="measured, the fewest that reach 90% of the best prompt throughput",
        help="Tokens a step with prompt chunks in it may run, at least --max-step-tokens; a longer prompt is "
        "prefilled in chunks over several steps, beside running streams.",
        doc="One chunk at `max_step_tokens`, twice that, … while a doubling gains ≥ 1 / 0.9 (SmolLM2 on 2 "
        "cores: 379 prompt tokens/s in chunks of 128, 442 in 256, 448 in 512).")
    # Fair shares (engine/scheduler.py): while a key that is served less than the busiest one has rows
    # in a step, the step is sized so that it costs at most max_slowdown × what that key's own rows
    # alone would cost (a quiet key's request then takes at most about max_slowdown × its idle time,
    # plus the wait for the step in flight when it arrives). Step cost is measured at start-up (the
    # cost of a step by its tokens, StepCost), or modelled as step_overhead_tokens + tokens if set.
    max_slowdown: float = setting(
        1.25, help="While a lighter key (or a higher priority class) has work in a step, the step costs at most "
        "this many times that work alone; see docs/engine.md (scheduler).")
    # A closed-loop client's next request (a chat turn, an SDK loop) is on its way and would otherwise
    # arrive to find a full step of the heavy key's in flight.
    linger_s: float = setting(
        0.2, help="Seconds a lighter key stays protected by --max-slowdown after its work ends, so its next "
        "request does not arrive to a full step; 0: no lingering.")
    step_overhead_tokens: int | None = setting(
        None, default_text="measured at start-up",
        help="A step's fixed cost in token-equivalents, for the scheduler's cost model of overhead + tokens.",
        doc="Unset, a step's cost by its tokens (a curve), a prefill chunk's and the adapters' own costs are "
        "measured at start-up (`step_costs.measure_step_cost`).")
    # Training beside serving: a forward_backward runs in slices (gradient accumulation: the result
    # equals one pass) while sampling work waits.
    train_slice_tokens: int = setting(
        512, help="While sampling work waits, a training pass runs in micro-batches of at most this many tokens "
        "(packed: real tokens; padded otherwise) with sampler steps between them.")
    sample_steps_per_slice: int = setting(4, help="Sampler steps between two training slices.")
    max_fused_tokens: int = setting(
        32768, help="Tokens in one fused training pass (real when packed, padded otherwise); more are split into "
        "micro-batches. The peak training memory follows it: set it to one run's batch for no more peak "
        "memory than one run alone.")
    # Training memory. A fused pass never holds more than its largest request would alone (it
    # recomputes blocks and chunks its logits to that size: Trainer.memory_plan); a request alone
    # runs at full speed up to these bounds (docs/training-speed.md).
    checkpoint_from_tokens: int = setting(
        2048, help="Block activations a training pass keeps for backward, in tokens; 0: no bound. A pass of "
        "T > B tokens recomputes its first ceil((1 - B/T) x layers) blocks in backward, so activation memory "
        "stops growing with the batch, for that share of one more forward.",
        doc="Whatever it is, a fused pass bigger than its largest request alone recomputes blocks until it keeps "
        "no more block activations than that request alone (fusing never raises the peak).")
    # The log-softmax and its backward run in the logits' own buffer, so this is the logits stage's
    # whole peak (an 8 x 256 SmolLM2 batch's 402 MB fit; chunked at 128 its step is ~9% slower).
    logits_chunk_mb: float = setting(
        512.0, help="Most fp32 logits one training pass holds at once, MiB; bigger logits run in position "
        "chunks recomputed in backward.",
        doc="A fused pass bigger than its largest request alone chunks at that request's logits.")
    max_num_samples: int = setting(128, flag=None, advertise=True, help="Samples per request.")
    max_top_logprobs: int = setting(
        20, flag=None, advertise=True,
        help="Alternatives reported per sampled token (OpenAI's top_logprobs; each costs a top-k per step).")
    max_batch_rows: int = setting(256, flag=None, help="Running sequences at once.")
    records_ttl_s: float = setting(3600.0, flag=None, help="Seconds a sampled sequence's logprobs stay on record for losses that read them back (stable_reinforce).")
    loader_threads: int = setting(2, flag=None, help="Store reads (adapter loads) in parallel.")
    # A burst of cold loads reads and decodes on the cores the engine's steps run on; at equal priority
    # it takes their share of the CPU and every running stream slows, while loads only need to land a
    # step ahead.
    loader_nice: int = setting(10, flag=None, help="Niceness the loader threads add to the process's own "
                               "(Linux; 0: none).")
    load_bytes_per_step: int = setting(
        256 * 1024 * 1024, flag=None, default_text="256 MiB",
        help="Bytes copied host to device slots between two steps (at least one adapter per step).")
    store_dir: Path | None = setting(
        None, flag=None, default_text="mint serve: the data dir's pages/; else a private temporary dir",
        help="Where paged-out training state lives.")
    threads: int | None = setting(
        None, default_text="the cores this process may run on",
        help="Intra-op threads of the engine's tensor math.")
    # (engine/host_memory.py: no page faults on every step's big blocks; RSS stays at its peak, and
    # varied block sizes fragment the heap, so it is opt-in.)
    keep_freed_memory: bool = setting(
        False, help="CPU: keep freed host memory for the next step instead of returning it to the kernel: no page "
        "faults on every training step's big blocks (about 5% of an 8 x 256 SmolLM2 step), while the RSS stays at "
        "its peak. See docs/training-speed.md.",
        doc="Varied block sizes fragment the heap (a GRPO run's peak grew), so it is opt-in.")
    # Rank 0 is the server process and schedules; ranks 1..tp-1 are spawned processes that run its
    # tensor work on their share (engine/tp_runner.py).
    tp: int = setting(
        1, help="Tensor-parallel ranks of the engine's model: this process is rank 0 and schedules, tp-1 spawned "
        "processes run their share (gloo on CPU, NCCL on CUDA: one GPU per rank). See docs/scale-up.md.")
    # Idle ranks wait for their next op without a limit.
    tp_timeout_s: float = setting(
        300.0, flag=None, help="Seconds a tensor-parallel collective may wait for its peers: a rank that is alive "
        "but stuck fails the op it holds with EngineFailed after this, instead of rank 0 waiting forever.")
    # model/invariant.py. Dense families on one rank; costs padding and smaller kernels.
    batch_invariant: bool = setting(
        False, advertise=True,
        help="Bitwise batch-invariant numerics: a row's logits, logprobs, tokens and gradients never depend on "
        "its batch, and sampled logprobs equal the training forward's (true on-policy RL). Dense families, one "
        "rank; slower. See docs/numerics.md.",
        doc="Checked against the machine's kernels at start-up.")
    # model/compiled.py. The test suite runs eager unless a test asks (MINT_COMPILE=off).
    compile: str = setting(
        default_factory=lambda: os.environ.get("MINT_COMPILE", "auto"), default_text="auto, or $MINT_COMPILE",
        help="auto or off: serving steps (decode rows, prefill chunks) and LoRA training blocks as compiled graphs, "
        "compiled at start-up before the engine serves (minutes on a cold cache, less than a minute warm), cached "
        "in the data dir's compile-cache; off: always eager, ready at once. See docs/engine.md.")
    # engine/kv.py, docs/engine.md "Prefix cache".
    prefix_cache: bool = setting(
        True, help="Keep full KV blocks of earlier requests for later ones with the same prefix: a chat's next "
        "turn prefills only what is new. Per owner, adapter revision and base; evicted least recently used. "
        "See docs/engine.md.",
        doc="Off by itself on hybrid (linear-attention) and vision bases.")
    compile_cache_dir: Path | None = setting(
        None, flag=None, default_text="mint serve: the data dir's compile-cache/; else inductor's own",
        help="Where inductor keeps compiled kernels and graphs, so a restart compiles warm.")
    # model/quantize.py. A decode step reads a quarter (int8) or about an eighth (int4) of the base's
    # fp32 bytes.
    quantize: str = setting(
        "none", advertise=True,
        help="none, int8 or int4: quantize the frozen base's linear weights at load (weight-only; int8 per "
        "channel, int4 in groups); LoRA adapters train and serve on top in full precision (QLoRA). Less memory "
        "and, on CPU, faster decode. See docs/quantization.md.")

    def check(self) -> None:
        """InvalidSetting (a ValueError) naming the first field out of range."""
        positive = ("device_slots", "max_rank", "kv_budget_tokens", "max_fused_tokens",
                    "max_num_samples", "max_batch_rows", "loader_threads", "load_bytes_per_step", "tp",
                    "train_slice_tokens", "sample_steps_per_slice")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidSetting(name, f"must be a positive integer, got {value!r}")
        if not (isinstance(self.max_slowdown, int | float) and math.isfinite(self.max_slowdown)
                and self.max_slowdown >= 1):
            raise InvalidSetting("max_slowdown", f"must be a number >= 1, got {self.max_slowdown!r}")
        if not (isinstance(self.linger_s, int | float) and math.isfinite(self.linger_s) and self.linger_s >= 0):
            raise InvalidSetting("linger_s", f"must be a number of seconds >= 0, got {self.linger_s!r}")
        if self.max_step_tokens is not None and (not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 1):
            raise InvalidSetting("max_step_tokens", f"must be a positive integer, got {self.max_step_tokens!r}")
        if self.max_chunk_tokens is not None and (not isinstance(self.max_chunk_tokens, int) or self.max_chunk_tokens < 1):
            raise InvalidSetting("max_chunk_tokens", f"must be a positive integer, got {self.max_chunk_tokens!r}")
        if self.step_overhead_tokens is not None and (
                not isinstance(self.step_overhead_tokens, int) or self.step_overhead_tokens < 0):
            raise InvalidSetting("step_overhead_tokens", f"must be an integer >= 0, got {self.step_overhead_tokens!r}")
        if not isinstance(self.loader_nice, int) or not 0 <= self.loader_nice <= 19:
            raise InvalidSetting("loader_nice", f"must be an integer in 0..19, got {self.loader_nice!r}")
        if not isinstance(self.max_top_logprobs, int) or self.max_top_logprobs < 0:
            raise InvalidSetting("max_top_logprobs", f"must be an integer >= 0, got {self.max_top_logprobs!r}")
        if not (isinstance(self.tp_timeout_s, int | float) and math.isfinite(self.tp_timeout_s)
                and self.tp_timeout_s > 0):
            raise InvalidSetting("tp_timeout_s", f"must be a number > 0, got {self.tp_timeout_s!r}")
        if not isinstance(self.host_cache_mb, int | float) or not self.host_cache_mb >= 0:
            raise InvalidSetting("host_cache_mb", f"must be >= 0, got {self.host_cache_mb!r}")
        if self.kv_budget_mb is not None and not (isinstance(self.kv_budget_mb, int | float) and self.kv_budget_mb > 0):
            raise InvalidSetting("kv_budget_mb", f"must be > 0, got {self.kv_budget_mb!r}")
        if not isinstance(self.checkpoint_from_tokens, int) or self.checkpoint_from_tokens < 0:
            raise InvalidSetting("checkpoint_from_tokens", f"must be an integer >= 0, got {self.checkpoint_from_tokens!r}")
        if not (isinstance(self.logits_chunk_mb, int | float) and self.logits_chunk_mb > 0):
            raise InvalidSetting("logits_chunk_mb", f"must be > 0, got {self.logits_chunk_mb!r}")
        for name in ("batch_invariant", "keep_freed_memory", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSetting(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.batch_invariant and self.tp != 1:
            raise InvalidSetting("batch_invariant", "is supported on one rank only (tp=1)")
        if self.quantize not in QUANTIZE_CHOICES:
            raise InvalidSetting("quantize", f"must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        if self.quantize != "none" and (self.tp != 1 or self.batch_invariant):
            # the quantized products are neither split over ranks nor batch-invariant (model/quantize.py)
            raise InvalidSetting("quantize", f"{self.quantize} is supported on one rank (tp=1) without batch_invariant")
        if self.compile not in ("auto", "off"):
            raise InvalidSetting("compile", f"must be auto or off, got {self.compile!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidSetting("threads", f"must be a positive integer, got {self.threads!r}")
        if self.max_context is not None and self.max_context < 2:
            raise InvalidSetting("max_context", f"must be at least 2, got {self.max_context!r}")
        if not (isinstance(self.records_ttl_s, int | float) and math.isfinite(self.records_ttl_s)
                and self.records_ttl_s > 0):
            raise InvalidSetting("records_ttl_s", f"must be > 0, got {self.records_ttl_s!r}")

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


@dataclass(frozen=True)
class SettingInfo:
    """One EngineSettings field as the CLI, the capabilities and the docs present it."""

    name: str
    type: type  # the value's type without None (int, float, bool, str, Path)
    default: Any  # a fresh EngineSettings' value (environment included)
    flag: str | None  # `mint serve`'s option, e.g. "--max-seq-len"; None: not a flag
    help: str
    default_text: str  # the default in words: default_text, or the value written out
    doc: str
    advertise: bool
    deprecated_flags: tuple[str, ...]

    @property
    def flag_decls(self) -> tuple[str, ...]:
        """The option's declarations for click: a bool is an on/off pair."""
        if self.flag is None:
            return ()
        return (f"{self.flag}/--no-{self.flag[2:]}",) if self.type is bool else (self.flag,)


def _written(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def setting_infos() -> tuple[SettingInfo, ...]:
    """Every EngineSettings field, in declaration order, with its help, flag, type and default."""
    hints = get_type_hints(EngineSettings)
    defaults = EngineSettings()
    infos = []
    for f in fields(EngineSettings):
        m = f.metadata
        kinds = [t for t in getattr(hints[f.name], "__args__", (hints[f.name],)) if t is not type(None)]
        flag = "--" + f.name.replace("_", "-") if m["flag"] == "" else m["flag"]
        default = getattr(defaults, f.name)
        infos.append(SettingInfo(name=f.name, type=kinds[0], default=default, flag=flag, help=m["help"],
                                 default_text=m["default_text"] or _written(default), doc=m["doc"],
                                 advertise=m["advertise"], deprecated_flags=m["deprecated_flags"]))
    return tuple(infos)


def advertised_settings(settings: EngineSettings, limits: EngineLimits) -> dict[str, Any]:
    """The settings marked `advertise`, as /api/v1/get_server_capabilities lists them: where the loaded
    model bounds a setting (max_context by the model's own context), the bound that holds."""
    return {i.name: getattr(limits, i.name) if hasattr(limits, i.name) else getattr(settings, i.name)
            for i in setting_infos() if i.advertise}


# The settings table in docs/engine.md sits between these markers; tests check it is what
# settings_table() writes (`python -m mint_server.engine.settings --write docs/engine.md` updates it).
TABLE_BEGIN = "<!-- settings:begin (generated by `python -m mint_server.engine.settings --write docs/engine.md`) -->"
TABLE_END = "<!-- settings:end -->"


def settings_table() -> str:
    """The markdown table of every EngineSettings field: its flag, default and meaning."""
    rows = ["| setting | `mint serve` flag | default | meaning |", "| --- | --- | --- | --- |"]
    for i in setting_infos():
        spelled = [" / ".join(f"`{d}`" for d in i.flag_decls[0].split("/"))] if i.flag else ["—"]
        flags = "; ".join([*spelled, *(f"`{d}` (deprecated)" for d in i.deprecated_flags)])
        meaning = f"{i.help} {i.doc}".strip().replace("|", "\\|")
        advertised = " Advertised in `get_server_capabilities`." if i.advertise else ""
        rows.append(f"| `{i.name}` | {flags} | {i.default_text} | {meaning}{advertised} |")
    return "\n".join(rows) + "\n"


def with_settings_table(text: str) -> str:
    """`text` (a markdown document) with the part between TABLE_BEGIN and TABLE_END replaced by the table."""
    head, begin, rest = text.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not (begin and end):
        raise ValueError(f"the document has no {TABLE_BEGIN} … {TABLE_END} markers")
    return f"{head}{TABLE_BEGIN}\n{settings_table()}{TABLE_END}{tail}"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="EngineSettings as a markdown table.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the table")
    group.add_argument("--write", type=Path, metavar="DOC", help="replace the table between the markers in DOC")
    args = parser.parse_args()
    if args.markdown:
        print(settings_table(), end="")
    else:
        args.write.write_text(with_settings_table(args.write.read_text()))
