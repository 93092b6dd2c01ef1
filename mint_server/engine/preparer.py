"""The one place requests are parsed into the engine's jobs (jobs.py): `Preparer` checks each field
against the engine's limits and raises EngineError naming the field. Pure and thread-safe."""

from __future__ import annotations

import dataclasses
import math
import secrets
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pydantic import ValidationError
from tinker import types

from mint_server.engine.custom_loss import CompiledLoss, datum_inputs
from mint_server.engine.grammar import Grammars
from mint_server.engine.jobs import (
    AdapterRef,
    CustomJob,
    OptimJob,
    Prompt,
    ReverseKLJob,
    SampleJob,
    SampleParams,
    TrainJob,
)
from mint_server.engine.losses import (
    LossSpec,
    ParsedDatum,
    SamplingRecordsLike,
    loss_spec,
    parse_datum,
    parse_kl_datum,
    resolve_config,
)
from mint_server.engine.optim import check_adam_params, check_dimuon_params, check_family
from mint_server.engine.sampler_ops import PromptTargets, StopCondition
from mint_server.engine.settings import EngineLimits
from mint_server.engine.values import EngineError, NotSupportedError, Priority
from mint_server.model.config import ModelConfig
from mint_server.model.images import ImageError, ImageProcessing, PromptImages

# Temperatures this small are greedy: dividing logits by them overflows to inf, and the draw would
# be the argmax anyway.
GREEDY_BELOW = 1e-5
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: ±100 bans or forces a token
INT64_MAX = 2**63 - 1
EXT = "sampling_params."  # where the Tinker face carries the extension fields (the OpenAI face drops it)

class Preparer:
    """Parses requests into jobs against one engine's limits. Thread-safe (reads only)."""

    def __init__(self, limits: EngineLimits, eos_token_ids: Sequence[int],
                 decode: Callable[[list[int]], str] | None, records: SamplingRecordsLike | None,
                 grammars: Grammars | None = None, images: ImageProcessing | None = None) -> None:
        """grammars: compiles response_format (None: refused); images: how the base reads image chunks
        (None: a base that reads tokens only)."""
        self.limits = limits
        self.eos = StopCondition(token_ids=frozenset(int(t) for t in eos_token_ids))
        self.decode = decode
        self.records = records
        self.images = images
        self.grammars = grammars  # None: an engine without a tokenizer refuses response_format

    # --- training -------------------------------------------------------------------------------
    def train(self, datums: Sequence[types.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None,
              backward: bool = True, adapter_id: str | None = None, key: str = "") -> TrainJob:
        if not datums:
            raise EngineError("datums: empty batch")
        spec = loss_spec(loss_fn)
        config = resolve_config(spec, loss_fn_config)
        parsed = tuple(self._datum(d, i, spec) for i, d in enumerate(datums))
        return TrainJob(parsed, spec, config, bool(backward), adapter_id, key)

    def _datum(self, datum: types.Datum, i: int, spec: LossSpec) -> ParsedDatum:
        """parse_datum, with a model input's image chunks read into the datum's images."""
        lim = self.limits
        model_input = getattr(datum, "model_input", None)
        images = None
        if isinstance(model_input, types.ModelInput) and self._has_images(model_input, f"datums[{i}].model_input"):
            tokens, images = self.expand(model_input, f"datums[{i}].model_input")
            datum = dataclasses.replace(datum, model_input=types.ModelInput.from_ints(tokens))
        parsed = parse_datum(datum, i, spec, lim.vocab_size, lim.max_context, self.records)
        if images is None:
            self._check_no_placeholder(parsed.tokens, f"datums[{i}].model_input")
        return dataclasses.replace(parsed, images=images)

    def reverse_kl(self, datums: Sequence[Any], temperature: float, reference: AdapterRef = None,
                   adapter_id: str | None = None) -> ReverseKLJob:
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
                math.isfinite(temperature) and temperature > 0):
            raise EngineError(f"temperature: must be a finite number > 0, got {temperature!r}")
        if not datums:
            raise EngineError("datums: empty batch")
        lim = self.limits
        rows = tuple(parse_kl_datum(d, i, lim.vocab_size, lim.max_context) for i, d in enumerate(datums))
        return ReverseKLJob(rows, float(temperature), reference, adapter_id)

    def optim(self, params: Any, adapter_id: str | None = None, family: str | None = None) -> OptimJob:
        """AdamParams, or DimuonParams (which may arrive as the SDK's generic OptimParamsBase); with
        `family`, they must be that optimizer family's (the adapter's, fixed for its life)."""
        if isinstance(params, types.AdamParams):
            check_adam_params(params)
            if family is not None:
                check_family(params, family)
            return OptimJob(params, adapter_id)
        data = params.model_dump() if hasattr(params, "model_dump") else params
        if not isinstance(data, dict) or data.get("type") != "dimuon":
            kind = data.get("type") if isinstance(data, dict) else type(params).__name__
            raise EngineError(f"optim_params: {kind!r} is not supported; AdamParams or DimuonParams")
        try:
            dimuon = types.DimuonParams.model_validate(data)
        except ValidationError as e:  # its first complaint, by field
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise EngineError(f"invalid DimuonParams: {first['msg']}",
                              field=f"optim_params.{where}" if where else "optim_params") from None
        check_dimuon_params(dimuon)
        if family is not None:
            check_family(dimuon, family)
        return OptimJob(dimuon, adapter_id)

    def custom(self, datums: Sequence[types.Datum], loss: CompiledLoss) -> CustomJob:
        """A forward_backward with an uploaded custom loss; EngineError names the datum and field."""
        if not datums:
            raise EngineError("datums: empty batch")
        inputs = tuple(tuple(datum_inputs(loss, d, i)) for i, d in enumerate(datums))
        forward = self.train([types.Datum(model_input=d.model_input,
                                          loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
                              for d in datums], "cross_entropy", None, backward=False)
        for i, d in enumerate(forward.datums):
            if d.inputs["target_tokens"].ndim != loss.inputs[0][1]:
                raise EngineError(f"datums[{i}].loss_fn_inputs.target_tokens: rank {d.inputs['target_tokens'].ndim}, "
                                  f"loss {loss.name!r} declared logprobs with rank {loss.inputs[0][1]}")
        return CustomJob(forward, inputs, loss)

    # --- sampling -------------------------------------------------------------------------------
    def sample(
        self, adapter: AdapterRef, prompt_tokens: Sequence[int] | types.ModelInput | Prompt, num_samples: int,
        params: types.SamplingParams,
        prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, *, record: bool = False, key: str = "",
        stop_at_eos: bool = False, top_logprobs: int = 0, frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0, priority: Priority = Priority.ROLLOUT, repetition_penalty: float = 1.0,
        min_p: float = 0.0, logit_bias: Any = None, response_format: Any = None, stop_token_ids: Any = None,
        target_prompt_logprobs: Any = None, prompt_alt_tokens_k: int = 0, prompt_logprobs_last_n: int | None = None,
        logprobs_mode: str | None = None,
    ) -> SampleJob:
        """The extension fields (penalties, min_p, logit_bias, response_format, stop_token_ids,
        logprobs_mode) are named `sampling_params.X` in errors, where the Tinker face carries them.
        target_prompt_logprobs (a TensorData, dense or CSR), prompt_alt_tokens_k and
        prompt_logprobs_last_n are tinker 0.38's SampleRequest fields of those names."""
        prompt, images = self._prompt(prompt_tokens, room=1)
        lim = self.limits
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not (
                1 <= num_samples <= lim.max_num_samples):
            raise EngineError(f"num_samples: must be an integer in 1..{lim.max_num_samples}, got {num_samples!r}")
        if isinstance(topk_prompt_logprobs, bool) or not isinstance(topk_prompt_logprobs, int) or not (
                0 <= topk_prompt_logprobs <= lim.vocab_size):
            raise EngineError(f"topk_prompt_logprobs: must be in 0..{lim.vocab_size}, got {topk_prompt_logprobs!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not (
                0 <= top_logprobs <= lim.max_top_logprobs):
            raise EngineError(f"top_logprobs: must be an integer in 0..{lim.max_top_logprobs}, got {top_logprobs!r}")
        run = uuid.uuid4().hex[:16]
        parsed = self._params(params, len(prompt))
        repetition = _finite(repetition_penalty, f"{EXT}repetition_penalty")
        if not 0 < repetition <= MAX_REPETITION_PENALTY:
            raise EngineError(f"{EXT}repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                              f"got {repetition_penalty!r}")
        floor = _finite(min_p, f"{EXT}min_p")
        if not 0 <= floor <= 1:
            raise EngineError(f"{EXT}min_p: must be in [0, 1] (0 = off), got {min_p!r}")
        grammar = None
        if response_format is not None:
            if self.grammars is None:
                raise EngineError(f"{EXT}response_format: structured output needs a tokenizer, and this engine has none")
            grammar = self.grammars.parse(response_format, f"{EXT}response_format")
        parsed = dataclasses.replace(parsed, frequency_penalty=_finite(frequency_penalty, f"{EXT}frequency_penalty"),
                                     presence_penalty=_finite(presence_penalty, f"{EXT}presence_penalty"),
                                     repetition_penalty=repetition, min_p=floor,
                                     logit_bias=self._logit_bias(logit_bias), grammar=grammar)
        stop_ids = self._stop_token_ids(stop_token_ids) | (self.eos.token_ids if stop_at_eos else frozenset())
        if stop_ids:
            parsed = dataclasses.replace(parsed, stop=dataclasses.replace(
                parsed.stop, token_ids=parsed.stop.token_ids | stop_ids))
        if logprobs_mode not in (None, "raw_logprobs", "processed_logprobs"):
            raise EngineError(f"{EXT}logprobs_mode: must be 'raw_logprobs' (the default) or 'processed_logprobs', "
                              f"got {logprobs_mode!r}")
        if logprobs_mode == "processed_logprobs":
            parsed = dataclasses.replace(parsed, processed_logprobs=True)
        # Its cost, (len(prompt) - 1) × k draws, is bounded as topk_prompt_logprobs' is: at most a
        # whole context's worth of vocabulary-wide rows.
        most_alt = lim.max_context * lim.vocab_size // max(1, len(prompt) - 1)
        if isinstance(prompt_alt_tokens_k, bool) or not isinstance(prompt_alt_tokens_k, int) or not (
                0 <= prompt_alt_tokens_k <= most_alt):
            raise EngineError(f"prompt_alt_tokens_k: must be an integer in 0..{most_alt} for this prompt "
                              f"((len(prompt) - 1) × k at most context × vocabulary), got {prompt_alt_tokens_k!r}")
        if prompt_alt_tokens_k and len(prompt) < 2:
            raise EngineError("prompt_alt_tokens_k: the prompt needs at least 2 tokens (position 0 has no context)")
        last_n = prompt_logprobs_last_n
        if last_n is not None:
            if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n <= len(prompt) - 1:
                raise EngineError(f"prompt_logprobs_last_n: must be an integer in 1..len(prompt) - 1 = "
                                  f"{len(prompt) - 1}, got {last_n!r}")
            if not prompt_logprobs:
                raise EngineError("prompt_logprobs_last_n: requires prompt_logprobs")
        targets = None if target_prompt_logprobs is None else self._targets(target_prompt_logprobs, len(prompt))
        return SampleJob(
            adapter=adapter, prompt=prompt, num_samples=num_samples, params=parsed,
            sequence_ids=tuple(f"seq-{run}-{i}" for i in range(num_samples)),
            prompt_logprobs=bool(prompt_logprobs), topk_prompt_logprobs=topk_prompt_logprobs,
            top_logprobs=top_logprobs, record=bool(record), key=key, priority=Priority(priority), images=images,
            target_prompt_logprobs=targets, prompt_alt_tokens_k=prompt_alt_tokens_k, prompt_logprobs_last_n=last_n,
        )

    def _targets(self, t: Any, prompt_len: int) -> PromptTargets:
        """target_prompt_logprobs: an int64 [len(prompt) - 1, K] tensor of token ids (-1: nothing),
        dense or sparse CSR, with at least one id; K at most the vocabulary (its cost, len(prompt) × K,
        is bounded as topk_prompt_logprobs' is)."""
        where = "target_prompt_logprobs"
        lim = self.limits
        if getattr(t, "dtype", None) != "int64":
            raise EngineError(f"{where}: must be an int64 tensor of token ids, got dtype {getattr(t, 'dtype', None)!r}")
        shape = getattr(t, "shape", None)
        if shape is None or len(shape) != 2:
            raise EngineError(f"{where}: must be 2-D, [len(prompt) - 1, K], got shape {shape}")
        rows, width = int(shape[0]), int(shape[1])
        if rows != prompt_len - 1:
            raise EngineError(f"{where}: must have len(prompt) - 1 = {prompt_len - 1} rows, got {rows}")
        if not 1 <= width <= lim.vocab_size:
            raise EngineError(f"{where}: K (its second dimension) must be in 1..{lim.vocab_size}, got {width}")
        try:
            ids = np.asarray(list(t.data), dtype=np.int64)
            crow = None if t.sparse_crow_indices is None else np.asarray(t.sparse_crow_indices, dtype=np.int64)
            col = None if t.sparse_col_indices is None else np.asarray(t.sparse_col_indices, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise EngineError(f"{where}: must hold integer token ids") from None
        if ids.ndim != 1 or (crow is not None and crow.ndim != 1) or (col is not None and col.ndim != 1):
            raise EngineError(f"{where}: data and CSR indices must be flat lists")
        if (crow is None) != (col is None):
            raise EngineError(f"{where}: sparse_crow_indices and sparse_col_indices go together")
        if crow is None:
            if len(ids) != rows * width:
                raise EngineError(f"{where}: shape {list(shape)} holds {rows * width} ids, data has {len(ids)}")
        else:
            assert col is not None
            if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(ids) or len(col) != len(ids) or bool(
                    (np.diff(crow) < 0).any()):
                raise EngineError(f"{where}: sparse_crow_indices must be {rows + 1} non-decreasing row pointers "
                                  f"from 0 to len(data) = {len(ids)} = len(sparse_col_indices)")
            if len(col) and (col.min() < 0 or col.max() >= width):
                raise EngineError(f"{where}: sparse_col_indices must be in [0, {width})")
            row_start = np.zeros(len(col), dtype=bool)
            row_start[crow[:-1][crow[:-1] < len(col)]] = True
            if bool(((col[1:] <= col[:-1]) & ~row_start[1:]).any()):
                raise EngineError(f"{where}: sparse_col_indices must increase within each row")
        bad = ids[(ids < -1) | (ids >= lim.vocab_size)]
        if bad.size:
            raise EngineError(f"{where}: token id {int(bad[0])} is outside the vocabulary [0, {lim.vocab_size}) "
                              "(-1 requests nothing)")
        if not (ids >= 0).any():
            raise EngineError(f"{where}: names no token id (every cell is -1)")
        return PromptTargets((rows, width), ids, crow, col)

    def _logit_bias(self, value: Any) -> tuple[tuple[int, float], ...]:
        """{token id (an int, or its decimal string as JSON keys are): bias in [-100, 100]}."""
        where = f"{EXT}logit_bias"
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise EngineError(f"{where}: must be an object mapping token ids to biases")
        lim = self.limits
        if len(value) > lim.max_logit_bias:
            raise EngineError(f"{where}: at most {lim.max_logit_bias} tokens, got {len(value)}")
        out: dict[int, float] = {}
        for key, bias in value.items():
            try:
                token = int(key) if isinstance(key, str) else _int(key)
            except (TypeError, ValueError):
                raise EngineError(f"{where}: keys must be token ids, got {key!r}") from None
            if not 0 <= token < lim.vocab_size:
                raise EngineError(f"{where}: token id {token} is outside the vocabulary [0, {lim.vocab_size})")
            if token in out:
                raise EngineError(f"{where}: token id {token} appears twice")
            b = _finite(bias, f"{where}[{key!r}]")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise EngineError(f"{where}[{key!r}]: must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
            if b:
                out[token] = b
        return tuple(out.items())

    def _stop_token_ids(self, value: Any) -> frozenset[int]:
        """Stop token ids next to stop strings (vLLM's stop_token_ids)."""
        where = f"{EXT}stop_token_ids"
        if value is None:
            return frozenset()
        if not isinstance(value, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise EngineError(f"{where}: must be a list of token ids")
        if len(value) > self.limits.max_stop_sequences:
            raise EngineError(f"{where}: at most {self.limits.max_stop_sequences} token ids, got {len(value)}")
        for t in value:
            if not 0 <= t < self.limits.vocab_size:
                raise EngineError(f"{where}: token id {t} is outside the vocabulary [0, {self.limits.vocab_size})")
        return frozenset(value)

    def score(self, adapter: AdapterRef, tokens: Sequence[int] | types.ModelInput | Prompt, *, key: str = "",
              priority: Priority = Priority.ROLLOUT) -> SampleJob:
        """SamplingClient.compute_logprobs: logprob of every token given the ones before."""
        prompt, images = self._prompt(tokens, room=0)
        params = SampleParams(max_tokens=0, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=StopCondition())
        return SampleJob(adapter=adapter, prompt=prompt, num_samples=1, params=params, sequence_ids=(),
                         prompt_logprobs=True, score_only=True, key=key, priority=Priority(priority), images=images)

    # --- images -------------------------------------------------------------------------------
    def _has_images(self, model_input: types.ModelInput, where: str) -> bool:
        """Whether a model input holds anything but token chunks (refused by name if this base cannot read it)."""
        for j, chunk in enumerate(model_input.chunks):
            if isinstance(chunk, types.EncodedTextChunk):
                continue
            if isinstance(chunk, types.ImageChunk) and self.images is None:
                raise NotSupportedError(f"{where}.chunks[{j}]: image chunks need a vision-language base model; "
                                        f"{self.limits.arch} reads tokens only")
            if isinstance(chunk, types.ImageAssetPointerChunk):
                raise NotSupportedError(f"{where}.chunks[{j}]: image_asset_pointer chunks are not supported (this "
                                        "server fetches nothing); send the image's bytes in an image chunk")
            if not isinstance(chunk, types.ImageChunk):
                raise NotSupportedError(f"{where}.chunks[{j}]: {getattr(chunk, 'type', type(chunk).__name__)!r} "
                                        "chunks are not supported (token and image chunks are)")
            return True
        return False

    def expand(self, model_input: types.ModelInput, where: str) -> tuple[list[int], PromptImages | None]:
        """A model input's token ids, each image chunk read (decoded, resized, cut into patches) and
        standing as its run of image tokens; EngineError names the chunk at fault."""
        if not self._has_images(model_input, where):
            return model_input.to_ints(), None
        assert self.images is not None
        tokens: list[int] = []
        images = []
        for j, chunk in enumerate(model_input.chunks):
            if isinstance(chunk, types.EncodedTextChunk):
                tokens.extend(chunk.tokens)
                continue
            try:
                image = self.images.read(chunk.data, chunk.format, start=len(tokens))
            except ImageError as e:
                raise EngineError(f"{where}.chunks[{j}]: {e}") from None
            if chunk.expected_tokens is not None and chunk.expected_tokens != image.tokens:
                raise EngineError(f"{where}.chunks[{j}].expected_tokens: {chunk.expected_tokens}, but this "
                                  f"{image.width}×{image.height} image is {image.tokens} tokens on this model")
            tokens.extend([self.images.image_token_id] * image.tokens)
            images.append(image)
            if len(tokens) > self.limits.max_context:  # before reading any more images
                raise EngineError(f"{where}: {len(tokens)} tokens (images counted) by chunk {j} exceed the "
                                  f"context length {self.limits.max_context}")
        self._check_no_placeholder([t for j, t in enumerate(tokens) if not _in_image(j, images)], where)
        return tokens, PromptImages(tuple(images))

    def _check_no_placeholder(self, tokens: Sequence[int], where: str) -> None:
        """The image token stands only for an image chunk's pixels: in a token chunk it has none."""
        if self.images is not None and self.images.image_token_id in tokens:
            raise EngineError(f"{where}: token id {self.images.image_token_id} is the image placeholder; "
                              "send images as image chunks")

    def prompt(self, model_input: types.ModelInput | Sequence[int], where: str = "prompt") -> Prompt:
        """A prompt parsed once: its image chunks read, the image placeholder refused outside them.
        (Its length against the context is the sample's own check: see `sample`.)"""
        images = None
        if isinstance(model_input, types.ModelInput):
            tokens, images = self.expand(model_input, where)
        else:
            tokens = model_input
        try:
            ids = tuple(_int(t) for t in tokens)
        except (TypeError, ValueError):
            raise EngineError(f"{where}: must be a list of integer token ids") from None
        if images is None:
            self._check_no_placeholder(ids, where)
        return Prompt(ids, images)

    def _prompt(self, tokens: Sequence[int] | types.ModelInput | Prompt, room: int) -> tuple[tuple[int, ...], PromptImages | None]:
        parsed = tokens if isinstance(tokens, Prompt) else self.prompt(tokens)
        return self._prompt_tokens(parsed.tokens, room), parsed.images

    def _prompt_tokens(self, tokens: Sequence[int], room: int) -> tuple[int, ...]:
        lim = self.limits
        try:
            prompt = tuple(_int(t) for t in tokens)
        except (TypeError, ValueError):
            raise EngineError("prompt: must be a list of integer token ids") from None
        if not prompt:
            raise EngineError("prompt: must hold at least one token")
        for i, t in enumerate(prompt):
            if not 0 <= t < lim.vocab_size:
                raise EngineError(f"prompt: token id {t} at position {i} is outside the vocabulary [0, {lim.vocab_size})")
        if len(prompt) + room > lim.max_context:
            raise EngineError(
                f"prompt: {len(prompt)} tokens leave no room in the context length {lim.max_context}"
                if room else f"prompt: {len(prompt)} tokens exceed the context length {lim.max_context}"
            )
        return prompt

    def _params(self, p: types.SamplingParams, prompt_len: int) -> SampleParams:
        lim = self.limits
        room = lim.max_context - prompt_len
        max_tokens = p.max_tokens
        if max_tokens is None:  # one rule for every face (docs/wire-protocol.md): no open-ended KV reservation
            raise EngineError(f"sampling_params.max_tokens: required (at most {room} for this prompt)")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise EngineError(f"sampling_params.max_tokens: must be a positive integer, got {p.max_tokens!r}")
        if max_tokens > room:
            raise EngineError(
                f"sampling_params.max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the context length {lim.max_context}"
            )
        temperature = _finite(p.temperature, "sampling_params.temperature")
        if temperature < 0:
            raise EngineError(f"sampling_params.temperature: must be >= 0 (0 = greedy), got {p.temperature!r}")
        if temperature < GREEDY_BELOW:
            temperature = 0.0
        top_p = _finite(p.top_p, "sampling_params.top_p")
        if not 0 < top_p <= 1:
            raise EngineError(f"sampling_params.top_p: must be in (0, 1], got {p.top_p!r}")
        top_k = p.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k == 0 or top_k < -1 or top_k > INT64_MAX:
            raise EngineError(f"sampling_params.top_k: must be -1 (no limit) or a positive integer, got {top_k!r}")
        top_k = 0 if top_k == -1 or top_k >= lim.vocab_size else top_k
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= INT64_MAX:
            raise EngineError(f"sampling_params.seed: must be an integer in 0..2^63-1, got {p.seed!r}")
        return SampleParams(max_tokens, temperature, top_k, top_p, seed, self._stop(p.stop))

    def _stop(self, stop: Any) -> StopCondition:
        if stop is None:  # the SDK's default: stop at EOS; an explicit list replaces it ([] = never stop)
            return self.eos
        items = [stop] if isinstance(stop, str) else list(stop)
        lim = self.limits
        if len(items) > lim.max_stop_sequences:
            raise EngineError(f"sampling_params.stop: at most {lim.max_stop_sequences} stop sequences, got {len(items)}")
        if all(isinstance(s, str) for s in items):
            if not all(items) or any(len(s) > lim.max_stop_chars for s in items):
                raise EngineError(f"sampling_params.stop: stop strings must be non-empty and at most "
                                  f"{lim.max_stop_chars} characters")
            if items and self.decode is None:
                raise EngineError("sampling_params.stop: stop strings need a tokenizer, and this engine has none")
            return StopCondition(strings=tuple(items), decode=self.decode)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
            bad = [t for t in items if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise EngineError(f"sampling_params.stop: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.limits.vocab_size})")
            return StopCondition(token_ids=frozenset(items))
        raise EngineError("sampling_params.stop: must be a string, a list of strings or a list of token ids")


def image_processing(cfg: ModelConfig, model_dir: Any) -> ImageProcessing | None:
    """How the base reads image chunks (its preprocessor_config.json), or None for a text-only base."""
    return None if cfg.vision is None else ImageProcessing.for_model(cfg.vision, model_dir)


def image_tokens(cfg: ModelConfig) -> tuple[int, int, int] | None:
    """EngineLimits.image_tokens of this base."""
    v = cfg.vision
    return None if v is None else (v.vision_start_token_id, v.image_token_id, v.vision_end_token_id)


def _in_image(position: int, images: Sequence[Any]) -> bool:
    return any(im.start <= position < im.end for im in images)


def _int(t: Any) -> int:
    if isinstance(t, bool) or not isinstance(t, int):
        if isinstance(t, float) and t.is_integer():
            return int(t)
        raise TypeError(t)
    return t


def _finite(value: Any, where: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise EngineError(f"{where}: must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise EngineError(f"{where}: must be finite, got {value!r}")
    return x
