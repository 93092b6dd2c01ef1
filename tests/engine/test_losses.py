"""Each Tinker loss vs a direct, per-datum implementation of its formula; input checking."""

import numpy as np
import pytest
import torch
from tinker import types

from mint_server.engine.interface import EngineError, NotSupportedError
from mint_server.engine.losses import LOSSES, loss_spec, pad_inputs, parse_datum, resolve_config

VOCAB, MAX_LEN = 50, 64


def reference_loss(name: str, lp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    """The formulas of docs/losses.md, written out for one datum of 1-D tensors."""
    if name == "cross_entropy":
        return -(x.get("weights", torch.ones_like(lp)) * lp).sum()
    q, adv = x["logprobs"], x["advantages"]
    ratio = torch.exp(lp - q)
    lo = x.get("clip_low_threshold", cfg.get("clip_low_threshold"))
    hi = x.get("clip_high_threshold", cfg.get("clip_high_threshold"))
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        return -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
    if name == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * lp * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    if name == "gspo":
        m = x["sequence_ratio_mask"]
        s = torch.exp(((lp - q) * m).sum() / m.sum())
        return -torch.min(s * adv, torch.clamp(s, lo, hi) * adv).sum()
    if name == "stable_reinforce":
        return -(torch.clamp(ratio.detach(), lo, hi) * lp * adv).sum()
    raise AssertionError(name)


def random_case(name: str, lengths: list[int], seed: int, spread: float):
    """Datums with random inputs for `name`, and the model logprobs for each of them."""
    g = torch.Generator().manual_seed(seed)
    spec = LOSSES[name]
    datums, lps = [], []
    for n in lengths:
        lp = torch.log(torch.rand(n, generator=g) * 0.98 + 0.01)
        inputs = {"target_tokens": torch.randint(0, VOCAB, (n,), generator=g)}
        for key in spec.required[1:] + tuple(k for k in spec.optional if k == "weights"):
            if key == "logprobs":
                inputs[key] = lp + torch.randn(n, generator=g) * spread
            elif key == "advantages":
                adv = torch.randn(n, generator=g)
                adv[: n // 4] = 0.0  # a "prompt" with no advantage
                inputs[key] = adv
            elif key == "sequence_ratio_mask":
                inputs[key] = (torch.arange(n) >= n // 4).float()
            elif key == "weights":
                inputs[key] = torch.rand(n, generator=g)
        if name == "stable_reinforce":
            inputs["logprobs"] = lp + torch.randn(n, generator=g) * spread
        datums.append(types.Datum(model_input=types.ModelInput.from_ints([1] * n), loss_fn_inputs=inputs))
        lps.append(lp)
    return datums, lps


CASES = [
    ("cross_entropy", None, 0.3),
    ("importance_sampling", None, 0.3),
    ("ppo", None, 0.3),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, 0.6),
    ("cispo", None, 0.3),
    ("dro", {"beta": 0.05}, 0.3),
    ("dro", {"beta": 2.0}, 0.5),
    ("gspo", None, 1e-3),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, 0.2),
    ("stable_reinforce", None, 0.5),
    ("stable_reinforce", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2}, 0.5),
]


@pytest.mark.parametrize(("name", "config", "spread"), CASES)
def test_loss_matches_its_formula(name, config, spread):
    datums, lps = random_case(name, [13, 7, 10], seed=sum(map(ord, name)) + len(CASES), spread=spread)
    spec = loss_spec(name)
    cfg = resolve_config(spec, config)
    parsed = [parse_datum(d, i, spec, VOCAB, MAX_LEN, None) for i, d in enumerate(datums)]
    T = max(len(p.tokens) for p in parsed)
    lp = torch.zeros(len(parsed), T, 1)
    for i, v in enumerate(lps):
        lp[i, : len(v), 0] = v
    lp.requires_grad_(True)
    x, mask = pad_inputs(parsed, T, torch.device("cpu"), fill={"weights": 1.0, **cfg})
    el = spec.fn(lp, x, mask, cfg)
    assert torch.all(el[mask == 0] == 0)  # padding contributes nothing
    el.sum().backward()

    for i, (d, v) in enumerate(zip(datums, lps, strict=True)):
        leaf = v.clone().requires_grad_(True)
        xs = {k: t.to_torch().float() for k, t in d.loss_fn_inputs.items() if k != "target_tokens"}
        ref = reference_loss(name, leaf, xs, cfg)
        ref.backward()
        n = len(v)
        torch.testing.assert_close(el[i, :n].sum(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lp.grad[i, :n, 0], leaf.grad, rtol=1e-5, atol=1e-6)
        assert torch.all(lp.grad[i, n:] == 0)


def test_per_token_thresholds_override_config():
    name = "ppo"
    datums, lps = random_case(name, [12], seed=5, spread=0.6)
    d = datums[0]
    lo, hi = torch.full((12,), 0.9), torch.full((12,), 1.05)
    d = types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "clip_low_threshold": lo,
                                                                "clip_high_threshold": hi})
    spec = loss_spec(name)
    cfg = resolve_config(spec, None)
    parsed = [parse_datum(d, 0, spec, VOCAB, MAX_LEN, None)]
    x, mask = pad_inputs(parsed, 12, torch.device("cpu"), fill=cfg)
    ours = spec.fn(lps[0][None, :, None], x, mask, cfg).sum()
    xs = {k: t.to_torch().float() for k, t in d.loss_fn_inputs.items() if k != "target_tokens"}
    torch.testing.assert_close(ours, reference_loss(name, lps[0], xs, cfg))
    assert not torch.allclose(ours, reference_loss(name, lps[0], {k: v for k, v in xs.items() if "clip" not in k}, cfg))


def test_cross_entropy_with_several_targets_per_position():
    g = torch.Generator().manual_seed(0)
    n, k = 9, 3
    targets, weights = torch.randint(0, VOCAB, (n, k), generator=g), torch.rand(n, k, generator=g)
    spec = loss_spec("cross_entropy")
    d = types.Datum(model_input=types.ModelInput.from_ints([1] * n),
                    loss_fn_inputs={"target_tokens": targets, "weights": weights})
    one_d = types.Datum(model_input=types.ModelInput.from_ints([1] * 5), loss_fn_inputs={"target_tokens": [1] * 5})
    parsed = [parse_datum(x, i, spec, VOCAB, MAX_LEN, None) for i, x in enumerate([d, one_d])]
    assert parsed[0].width == k and parsed[1].width == 1
    x, mask = pad_inputs(parsed, n, torch.device("cpu"), fill={"weights": 1.0})
    lp = torch.log(torch.rand(2, n, k, generator=g))
    el = spec.fn(lp, x, mask, {})
    torch.testing.assert_close(el[0].sum(), -(weights * lp[0]).sum())
    torch.testing.assert_close(el[1].sum(), -lp[1, :5, 0].sum())  # only its own first column counts


class FakeRecords:
    def __init__(self, records: dict[str, list[float]]) -> None:
        self.records = records

    def get(self, sequence_id: str) -> list[float] | None:
        return self.records.get(sequence_id)


def _sr_datum(adv, logprobs=None, sampled_id="s1", offset=0):
    """Prompt of 3 target positions, then 4 sampled ones from sequence `sampled_id`."""
    inputs = {"target_tokens": [1] * 7, "advantages": adv}
    if logprobs is not None:
        inputs["logprobs"] = logprobs
    d = types.Datum(model_input=types.ModelInput.from_ints([1] * 7), loss_fn_inputs=inputs)
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sampled_id, length=4),
                     types.SampledProvenanceSpan(sequence_id=sampled_id, length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sampled_id, offset=1, length=3),
                        types.SampledProvenanceSpan(sequence_id=sampled_id, offset=offset, length=4)],
    )


def test_stable_reinforce_reads_sampling_logprobs_by_sequence_id():
    spec = loss_spec("stable_reinforce")
    records = FakeRecords({"s1": [-0.5, -1.0, -1.5, -2.0, -2.5]})
    adv = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    p = parse_datum(_sr_datum(adv), 0, spec, VOCAB, MAX_LEN, records)
    np.testing.assert_array_equal(p.inputs["logprobs"][3:], [-0.5, -1.0, -1.5, -2.0])
    p = parse_datum(_sr_datum(adv, offset=1), 0, spec, VOCAB, MAX_LEN, records)
    np.testing.assert_array_equal(p.inputs["logprobs"][3:], [-1.0, -1.5, -2.0, -2.5])
    # the record wins over the datum's own logprobs; without a record, the datum's are used
    own = [-9.0] * 7
    p = parse_datum(_sr_datum(adv, own), 0, spec, VOCAB, MAX_LEN, records)
    np.testing.assert_array_equal(p.inputs["logprobs"][3:], [-0.5, -1.0, -1.5, -2.0])
    p = parse_datum(_sr_datum(adv, own, sampled_id="gone"), 0, spec, VOCAB, MAX_LEN, records)
    np.testing.assert_array_equal(p.inputs["logprobs"], own)
    # plain datums (no provenance) with their own logprobs work like importance-weighted REINFORCE
    plain = types.Datum(model_input=types.ModelInput.from_ints([1] * 7),
                        loss_fn_inputs={"target_tokens": [1] * 7, "advantages": adv, "logprobs": own})
    assert parse_datum(plain, 0, spec, VOCAB, MAX_LEN, None).inputs["logprobs"].tolist() == own


@pytest.mark.parametrize(
    ("datum", "match"),
    [
        (_sr_datum([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], sampled_id="gone"), "no sampling record for sequence 'gone'"),
        (_sr_datum([0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), r"advantages: nonzero on prompt positions 0\.\.2"),
        (_sr_datum([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], offset=3), "has 5 recorded tokens, span needs 7"),
        (types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                     loss_fn_inputs={"target_tokens": [1, 2], "advantages": [1.0, 1.0]}), "needs loss_fn_input_spans"),
    ],
)
def test_stable_reinforce_errors(datum, match):
    records = FakeRecords({"s1": [-0.5, -1.0, -1.5, -2.0, -2.5]})
    with pytest.raises(EngineError, match=match):
        parse_datum(datum, 0, loss_spec("stable_reinforce"), VOCAB, MAX_LEN, records)


def _datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    ("loss", "datum", "match"),
    [
        ("ppo", _datum([1, 2], target_tokens=[1, 2], logprobs=[0.0, 0.0]), r"loss_fn_inputs\.advantages is required"),
        ("cross_entropy", _datum([1, 2], target_tokens=[1, 2], mask=torch.ones(2)), "unexpected key 'mask'"),
        ("cross_entropy", _datum([1, 2, 3], target_tokens=[1, 2]), "length 2 does not match the model_input length 3"),
        ("cross_entropy", _datum([1, 2], target_tokens=[1, VOCAB]), f"token id {VOCAB} is outside the vocabulary"),
        ("cross_entropy", _datum([1, VOCAB + 3], target_tokens=[1, 2]), r"model_input: token id 53"),
        ("cross_entropy", _datum([1, 2], target_tokens=[1, 2], weights=[1.0, float("nan")]), "weights: contains NaN"),
        ("importance_sampling", _datum([1, 2], target_tokens=[1, 2], logprobs=[0.0, 0.0],
                                       advantages=[float("inf"), 0.0]), "advantages: contains NaN or inf"),
        ("ppo", _datum([1, 2], target_tokens=[[1, 2], [3, 4]], logprobs=[0.0, 0.0], advantages=[1.0, 1.0]),
         r"expected shape \[2\], got \[2, 2\]"),
        ("cross_entropy", _datum([], target_tokens=[]), "empty model input"),
        ("cross_entropy", _datum([1] * (MAX_LEN + 1), target_tokens=[1] * (MAX_LEN + 1)), "exceed the model's context"),
        ("cross_entropy", types.Datum(model_input=types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=[1]), types.ImageChunk(data=b"x", format="png", expected_tokens=1)]),
            loss_fn_inputs={"target_tokens": [1, 2]}), "only token chunks"),
    ],
)
def test_bad_datums_are_refused_naming_the_field(loss, datum, match):
    with pytest.raises(EngineError, match=match) as e:
        parse_datum(datum, 3, loss_spec(loss), VOCAB, MAX_LEN, None)
    assert str(e.value).startswith("datums[3]")


def test_config_checks():
    with pytest.raises(EngineError, match="loss_fn: unknown loss function 'nope'"):
        loss_spec("nope")
    with pytest.raises(NotSupportedError, match="loss_fn: 'custom'"):
        loss_spec("custom")
    with pytest.raises(EngineError, match=r"loss_fn_config\.beta is required for loss 'dro'"):
        resolve_config(loss_spec("dro"), None)
    with pytest.raises(EngineError, match="loss_fn_config: unknown key 'beta' for loss 'ppo'"):
        resolve_config(loss_spec("ppo"), {"beta": 1.0})
    with pytest.raises(EngineError, match=r"loss_fn_config\.clip_low_threshold must be a finite number"):
        resolve_config(loss_spec("ppo"), {"clip_low_threshold": float("nan")})
    with pytest.raises(EngineError, match="clip_low_threshold must not exceed clip_high_threshold"):
        resolve_config(loss_spec("cispo"), {"clip_low_threshold": 2.0})
    assert resolve_config(loss_spec("ppo"), {"clip_high_threshold": 1.3}) == {
        "clip_low_threshold": 0.8, "clip_high_threshold": 1.3}


def test_fused_target_logprobs_match_autograd():
    """The trainer's log_softmax-gather autograd function, duplicate targets included."""
    from mint_server.engine.losses import TargetLogprobs

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 5, 4), generator=g)
    targets[0, 0] = 7  # the same token four times at one position
    grad = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)
    ref_in = logits.clone().requires_grad_(True)
    (torch.log_softmax(ref_in, -1).gather(-1, targets) * grad).sum().backward()
    ours_in = logits.clone().requires_grad_(True)
    out = TargetLogprobs.apply(ours_in * 1.0, targets)  # fresh buffer: backward reuses it in place
    torch.testing.assert_close(out.double(), torch.log_softmax(logits, -1).gather(-1, targets).double())
    (out.double() * grad).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)
