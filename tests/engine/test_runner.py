"""One runner: a single process is a Runner over a Shard of one (world size 1), whose collectives and
splits are the identity, and through whose ops every slot, optimizer and training step runs."""

import pytest
import torch
from tinker import types

from mint_server.model import tp as tpmod
from mint_server.model.loader import load_model
from mint_server.model.tp_group import TP
from tests.engine.helpers import TrainerHarness as Trainer
from tests.engine.helpers import TrainRequest, make_residency
from tests.engine.test_training import sft_datums


@pytest.fixture(scope="module")
def model(train_llama_dir):
    return load_model(train_llama_dir, device="cpu")


def test_world_one_collectives_and_splits_are_the_identity_without_a_process_group():
    tp = TP(0, 1)
    x = torch.randn(3, 4)
    assert tp.all_gather_dim(x, 0) is x and tp.all_reduce_sum(x) is x
    assert tp.sum(2.5) == 2.5 and tp.all_true(True) and not tp.all_true(False)
    pairs = {"q_proj": (x, x.T), "o_proj": (x, x.T)}  # a column and a row target
    for out in (tpmod.shard_pairs(pairs, tp), tpmod.gather_pairs(pairs, tp)):
        assert all(a is pairs[t][0] and b is pairs[t][1] for t, (a, b) in out.items())  # no copy either
    moments = {"q_proj": (x, x, x.T, x.T)}
    assert all(m.data_ptr() == x.data_ptr() for m in tpmod.gather_moments(moments, "adamw", tp)["q_proj"])


def test_a_residency_runs_on_a_shard_of_one_and_its_store_round_trip_keeps_the_optimizer_betas(model):
    residency = make_residency(model.config, num_slots=1, max_rank=8, host_cache_mb=0)  # evicted → store
    trainer = Trainer(model, residency, base_model="tiny")
    runner = residency.runner
    assert runner.tp.world == 1 and runner.followers == [] and runner.shard.model is model
    aid = trainer.create_adapter(types.LoraConfig(rank=4, seed=0))
    (out,) = trainer.run([TrainRequest(aid, sft_datums([9, 5], seed=0), "cross_entropy")])
    assert not isinstance(out, Exception)
    trainer.optim_step(aid, types.AdamParams(learning_rate=1e-3, beta1=0.8, beta2=0.9))
    a = residency.get(aid)
    weights = residency.weights(aid).weights
    other = residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1)))  # no free slot: the store
    for wanted in (other, a):  # each takes the other's slot: to the host tier, then (no budget) the store
        residency.schedule([wanted])  # starts its page read
        assert wanted.loading is not None
        wanted.loading.result()
        residency.schedule([wanted])  # the read lands and `promote` fills the slot from the full copy
        assert wanted.slot is not None
        assert a.paged is not None or wanted is a
    assert a.slot is not None and a.optim.step == 1 and a.optim.betas == (0.8, 0.9)
    assert all(torch.equal(x, y) for t, pair in residency.weights(aid).weights.items()
               for x, y in zip(pair, weights[t], strict=True))
