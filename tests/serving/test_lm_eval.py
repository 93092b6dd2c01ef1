"""lm-evaluation-harness (PyPI `lm_eval`) scores against our OpenAI face, offline: its
`local-completions` model runs a loglikelihood (multiple-choice) task and a generation task given
as local files, on the tiny model behind a loopback server. Each choice's loglikelihood equals the
Tinker face's prompt logprobs over the same tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine
from tests.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

DOCS = [{"question": "the sky is", "choices": ["blue", "green", "loud"], "answer": 0},
        {"question": "two and two make", "choices": ["four", "five"], "answer": 0},
        {"question": "fire is", "choices": ["hot", "cold", "wet"], "answer": 0}]  # fmt: skip
CHOICE_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)
    with LiveServer(tiny_engine(model_dir), tmp_path_factory.mktemp("lmeval") / "data") as server:
        yield server


def test_lm_eval_local_completions_scores_and_generates(live: LiveServer, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (tasks / "tiny_gen.yaml").write_text(GEN_TASK.format(data=data))
    lm = LocalCompletionsAPI(base_url=f"{live.url}/v1/completions", model=BASE, tokenizer_backend="huggingface",
                             tokenizer=str(live.engine.model_dir), header={"Authorization": f"Bearer {KEY_A}"},
                             max_length=256, max_retries=1, num_concurrent=1)  # fmt: skip
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice", "tiny_gen"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks)))  # fmt: skip
    assert 0 <= out["results"]["tiny_choice"]["acc,none"] <= 1
    assert "exact_match,remove_whitespace" in out["results"]["tiny_gen"] or out["results"]["tiny_gen"]

    # Each choice's loglikelihood is the Tinker face's prompt logprobs summed over the choice's tokens.
    client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
    sc = client.create_sampling_client(base_model=BASE).result()
    checked = 0
    for sample in out["samples"]["tiny_choice"]:
        for (context, continuation), (resp,) in zip(sample["arguments"].values() if isinstance(sample["arguments"], dict)
                                                    else sample["arguments"], sample["resps"], strict=True):  # fmt: skip
            ctx, cont = lm._encode_pair(context, continuation)
            ref = sc.sample(types.ModelInput.from_ints(ctx + cont), 1, types.SamplingParams(max_tokens=1),
                            include_prompt_logprobs=True).result()  # fmt: skip
            want = sum(ref.prompt_logprobs[len(ctx):])
            got = float(resp[0])
            assert got == pytest.approx(want, abs=1e-4)
            checked += 1
    client.close("success")
    assert checked == sum(len(d["choices"]) for d in DOCS)
