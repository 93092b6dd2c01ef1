"""The continuous-batching sampler with images: greedy equal to transformers' generate (prompts
prefilled in chunks that cut through images, beside text-only and adapter rows), prompt logprobs
equal to the training forward, and prefix sharing that never takes one image for another."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from mint_server.engine.records import SamplingRecords
from mint_server.model.images import ImageProcessing
from mint_server.model.loader import load_model
from tests.engine.helpers import SamplerHarness, make_residency
from tests.model.test_parity import random_adapter
from tests.vision.helpers import hf_inputs, image_input, load_hf, vl_tolerance
from tests.vision.oracle import merged_params

TEXT = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


@pytest.fixture(scope="module", params=["vl_dir", "vl_moe_dir"])
def vl(request):
    model_dir = request.getfixturevalue(request.param)
    return model_dir, load_model(model_dir, device="cpu")


def make_sampler(model, model_dir, residency, **kw) -> SamplerHarness:
    kw = {"kv_slots": 8, "max_seq_len": 96, "block_size": 8, "records": SamplingRecords(), **kw}
    s = SamplerHarness(model, residency, **kw)
    s.prep.images = ImageProcessing.for_model(model.config.vision, model_dir)
    return s


def params(**kw) -> types.SamplingParams:
    return types.SamplingParams(**{"stop": [], "max_tokens": 8, "temperature": 0.0, **kw})


def drain(sampler: SamplerHarness) -> None:
    while sampler.has_work():
        sampler.step()
    assert sampler.kv_blocks_in_use == 0


def test_greedy_with_images_matches_transformers_generate(vl):
    model_dir, model = vl
    cfg = model.config
    reg = make_residency(cfg, num_slots=2, max_rank=8)
    weights = random_adapter(cfg, 4, seed=11)
    aid = reg.install(weights, trainable=False).id
    prompts = [image_input(cfg, TEXT, [(40, 24, 1), (24, 32, 2)]), image_input(cfg, TEXT[:2], [(32, 32, 3)]),
               types.ModelInput.from_ints([5, 6, 7, 8, 9])]
    adapters = [aid, None, aid]
    # 10 tokens a step: every image is prefilled over several chunks, beside the other rows' decode
    sampler = make_sampler(model, model_dir, reg, max_step_tokens=10)
    futures = [sampler.submit(a, p, 1, params()) for a, p in zip(adapters, prompts, strict=True)]
    drain(sampler)
    assert sampler.stats.prefill_chunks > 6
    got = [f.result().sequences[0].tokens for f in futures]

    hf = load_hf(model_dir)
    hf.generation_config.eos_token_id = None  # like stop=[]
    want: list = [None] * len(prompts)
    for merged in (False, True):  # the base's rows, then the adapter merged into the weights for its rows
        if merged:
            with torch.no_grad():
                new = merged_params(hf, cfg, weights)
                for name, w in hf.named_parameters():
                    if name in new:
                        w.copy_(new[name])
        for i, (a, p) in enumerate(zip(adapters, prompts, strict=True)):
            if (a is not None) == merged:
                inputs = hf_inputs(cfg, model_dir, p)
                with torch.no_grad():
                    out = hf.generate(**inputs, do_sample=False, max_new_tokens=8, pad_token_id=0)
                want[i] = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert got == want
    assert got[0] != got[2]  # the image, not only the adapter, steers the tokens


def test_prompt_logprobs_with_images_equal_the_training_forward(vl):
    model_dir, model = vl
    cfg = model.config
    reg = make_residency(cfg, num_slots=2, max_rank=8)
    sampler = make_sampler(model, model_dir, reg, max_step_tokens=7)
    prompt = image_input(cfg, TEXT, [(40, 24, 1), (24, 32, 2)])
    scored = sampler.compute_logprobs(None, prompt)
    drain(sampler)
    p = sampler.prep.prompt(prompt)
    n = len(p.tokens)
    positions = torch.arange(n)[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([p.tokens]), positions,
                                     vision=model.vision_input(positions, [(0, n, p.images)]))[0], -1)
    want = lp[:-1].gather(-1, torch.tensor(p.tokens[1:])[:, None])[:, 0]
    got = scored.result()
    assert got[0] is None and len(got) == n
    vl_tolerance(cfg).check(torch.tensor(got[1:]), want, "prompt logprobs with images")


def test_two_images_never_share_a_prefix_and_one_image_is_shared(vl_dir):
    model = load_model(vl_dir, device="cpu")
    cfg = model.config
    reg = make_residency(cfg, num_slots=2, max_rank=8)
    a, b = image_input(cfg, TEXT[:2], [(40, 24, 1)]), image_input(cfg, TEXT[:2], [(40, 24, 2)])  # same tokens
    sampler = make_sampler(model, vl_dir, reg)
    assert sampler.prep.prompt(a).tokens == sampler.prep.prompt(b).tokens
    fa, fb, fa2 = (sampler.submit(None, m, 1, params()) for m in (a, b, a))
    drain(sampler)
    assert sampler.stats.prompt_rows == 2  # a and its twin share one prefill; b has its own
    ra, rb, ra2 = (f.result() for f in (fa, fb, fa2))
    assert ra.prompt_cache_hit_tokens == 0 and rb.prompt_cache_hit_tokens == 0
    assert ra2.prompt_cache_hit_tokens == len(sampler.prep.prompt(a).tokens)
    assert ra2.sequences[0].tokens == ra.sequences[0].tokens
    assert sampler.executor.rank.features.encoded == 2  # each distinct image through the tower once

    def alone(m):
        s = make_sampler(model, vl_dir, reg)
        f = s.submit(None, m, 1, params())
        drain(s)
        return f.result().sequences[0]

    assert ra.sequences[0].tokens == alone(a).tokens and rb.sequences[0].tokens == alone(b).tokens
    assert ra.sequences[0].logprobs != rb.sequences[0].logprobs  # the other image: another answer
