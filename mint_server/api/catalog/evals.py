"""Evals that compare revisions: one dataset, one metric, several policy revisions, run through the
engine at once (every example of every revision is submitted together, so the engine batches them
across adapters), scored, and recorded as eval records on each revision.

A dataset is JSON lines `{"prompt": str, "target": str}` (`answer` or `completion` are read as the
target too). Metrics, each a mean over the examples:

* `exact_match` — the greedy completion, stripped, equals the target, stripped;
* `contains` — the target (stripped) occurs in the greedy completion;
* `regex` — the target is a regular expression that `re.search` finds in the greedy completion;
* `logprob` — the mean log-probability per token of the target given the prompt (teacher-forced:
  nothing is sampled).

Completions are greedy (temperature 0) up to `max_tokens`, stopping at EOS; with `chat`, the prompt is
rendered as one user message through the model's chat template. Used by `mint eval` (cli/evals.py)
on a local engine and by `POST /api/v1/mint/evals` on a server. No HTTP and no tensors here.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tinker import types

from mint_server.api.tinker.validate import InvalidInput
from mint_server.engine.interface import AdapterSource, Engine, EngineError, Priority

METRICS = ("exact_match", "contains", "regex", "logprob")
MAX_EXAMPLES = 10_000
MAX_REVISIONS = 32
TARGET_KEYS = ("target", "answer", "completion")


@dataclass(frozen=True)
class Example:
    prompt: str
    target: str


@dataclass(frozen=True)
class Target:
    """A revision to evaluate: its reference by number (`name@N`), content hash and adapter source."""

    ref: str
    sha256: str
    source: AdapterSource


@dataclass
class Score:
    ref: str
    sha256: str
    value: float
    n: int
    outputs: list[str]  # per example: the completion (or, for logprob, the target's mean logprob)


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise InvalidInput(f"metric: must be one of {', '.join(METRICS)}; got {metric!r}")
    return metric


def parse_jsonl(text: str) -> list[Any]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise InvalidInput(f"dataset line {number}: not JSON ({e})") from None
    return rows


def examples_from(rows: Sequence[Any], metric: str) -> list[Example]:
    """Checked examples; a bad row is a 400 naming its index (and, for `regex`, a bad pattern)."""
    if not rows:
        raise InvalidInput("dataset: holds no examples")
    if len(rows) > MAX_EXAMPLES:
        raise InvalidInput(f"dataset: at most {MAX_EXAMPLES} examples; got {len(rows)}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise InvalidInput(f"dataset[{i}]: must be an object with a non-empty string 'prompt'")
        target = next((row[k] for k in TARGET_KEYS if k in row), None)
        if not isinstance(target, str) or not target:
            raise InvalidInput(f"dataset[{i}]: needs a non-empty string 'target' (or 'answer' / 'completion')")
        if metric == "regex":
            try:
                re.compile(target)
            except re.error as e:
                raise InvalidInput(f"dataset[{i}].target: not a regular expression ({e})") from None
        out.append(Example(row["prompt"], target))
    return out


def dataset_id(label: str, examples: Sequence[Example]) -> str:
    """How eval records name the dataset: its label and a hash of its content, so that records of
    the same data compare and records of edited data do not."""
    digest = hashlib.sha256(json.dumps([[e.prompt, e.target] for e in examples]).encode()).hexdigest()
    return f"{label[:200]}@{digest[:12]}"


def correct(metric: str, output: str, target: str) -> bool:
    if metric == "exact_match":
        return output.strip() == target.strip()
    if metric == "contains":
        return target.strip() in output
    return re.search(target, output) is not None


class Evaluation:
    def __init__(self, engine: Engine, tokenizer: Any, metric: str, examples: Sequence[Example], *,
                 max_tokens: int = 64, chat: bool = False, key: str = "") -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.metric, self.examples = check_metric(metric), list(examples)
        self.max_tokens, self.key = max_tokens, key
        if not 1 <= max_tokens <= engine.limits.max_context:
            raise InvalidInput(f"max_tokens: must be in 1..{engine.limits.max_context}; got {max_tokens}")
        self.prompts = [self._prompt(e.prompt, chat, i) for i, e in enumerate(self.examples)]
        self.targets = [list(tokenizer(e.target, add_special_tokens=False)["input_ids"]) for e in self.examples]

    def _prompt(self, text: str, chat: bool, index: int) -> list[int]:
        if not chat:
            return list(self.tokenizer(text)["input_ids"])
        from mint_server.serving.chat import ChatError, ChatTemplate

        try:
            return ChatTemplate(self.tokenizer).render([{"role": "user", "content": text}])
        except ChatError as e:
            raise InvalidInput(f"dataset[{index}]: {e}") from None

    def jobs(self, target: Target) -> list[Any]:
        """Every example's engine job for one revision (batch priority: evals yield to serving),
        parsed: bad input is refused before anything runs."""
        jobs = []
        for i, (prompt, answer) in enumerate(zip(self.prompts, self.targets, strict=True)):
            try:
                if self.metric == "logprob":
                    jobs.append(self.engine.prepare_score(target.source, prompt + answer, key=self.key,
                                                          priority=Priority.BATCH))
                else:
                    params = types.SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
                    jobs.append(self.engine.prepare_sample(target.source, prompt, 1, params, key=self.key,
                                                           stop_at_eos=True, priority=Priority.BATCH))
            except EngineError as e:
                raise InvalidInput(f"dataset[{i}]: {e}") from None
        return jobs

    def score(self, target: Target, results: list[Any]) -> Score:
        """One revision's job results (for logprob: each token's logprob, None first; else
        SampleResponses), scored."""
        if self.metric == "logprob":
            per_example = []
            for prompt, answer, scores in zip(self.prompts, self.targets, results, strict=True):
                lps = [lp for lp in scores[len(prompt):len(prompt) + len(answer)] if lp is not None]
                per_example.append(sum(lps) / len(lps) if lps else 0.0)
            value = sum(per_example) / len(per_example)
            return Score(target.ref, target.sha256, value, len(results), [f"{v:.4f}" for v in per_example])
        outputs = [self.tokenizer.decode(r.sequences[0].tokens, skip_special_tokens=True) for r in results]
        hits = [correct(self.metric, o, e.target) for o, e in zip(outputs, self.examples, strict=True)]
        return Score(target.ref, target.sha256, sum(hits) / len(hits), len(hits), outputs)

    def run(self, targets: Sequence[Target], progress: Callable[[int], None] = lambda n: None) -> list[Score]:
        """Every revision's jobs parsed, then all submitted at once, then scored in order (blocking:
        for the CLI; the server awaits the same futures instead, see api/admin/service.py)."""
        submitted = self.submit(targets)
        scores = []
        try:
            for t, futures in submitted:
                scores.append(self.score(t, [f.result() for f in futures]))
                progress(len(scores))
        finally:
            self.cancel(submitted)
        return scores

    def submit(self, targets: Sequence[Target]) -> list[tuple[Target, list[Future]]]:
        if not 1 <= len(targets) <= MAX_REVISIONS:
            raise InvalidInput(f"revisions: between 1 and {MAX_REVISIONS}; got {len(targets)}")
        parsed = [(t, self.jobs(t)) for t in targets]  # all parsed before any runs
        return [(t, [self.engine.submit(job) for job in jobs]) for t, jobs in parsed]

    def cancel(self, submitted: Sequence[tuple[Target, list[Future]]]) -> None:
        """Stop what is still running (an eval that failed or was abandoned)."""
        for _, futures in submitted:
            for f in futures:
                if not f.done():
                    self.engine.cancel(f)


def resolve_targets(catalog: Any, owner: str, refs: Sequence[str], base_model: str) -> list[Target]:
    """The revisions `refs` name now (each pinned by number), checked to be for `base_model`."""
    targets = []
    for ref in refs:
        revision = catalog.resolve(owner, ref)
        policy = catalog.get_policy(owner, revision.policy)
        if policy.base_model != base_model:
            raise InvalidInput(f"{ref!r}: policy {policy.name!r} is for base model {policy.base_model!r}; "
                               f"this engine serves {base_model!r}")
        source = AdapterSource.of_revision(revision.sha256, lambda r=revision: catalog.read_payload(r))
        targets.append(Target(revision.ref, revision.sha256, source))
    return targets
