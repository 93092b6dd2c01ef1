"""The scheduler as pure policy: plans over plain work items, no model, no tensors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from mint_server.engine.interface import Priority
from mint_server.engine.scheduler import NO_FIT, Fit, Scheduler

_arrivals = itertools.count()


@dataclass(eq=False)
class Item:
    key: str
    pending: int = 1
    running: bool = True
    priority: int = Priority.ROLLOUT
    policy: str = ""
    blocks: int = 1  # held when running, needed when waiting
    ready: bool = True
    preemptible: bool = True
    decoding: bool = False
    arrival: int = field(default_factory=lambda: next(_arrivals))

    @property
    def held_blocks(self) -> int:
        return self.blocks if self.running else 0

    @property
    def held_rows(self) -> int:
        return 1 if self.running else 0

    def fit(self, free_blocks: int, free_rows: int) -> Fit:
        return Fit(1, self.blocks, 1) if self.blocks <= free_blocks and free_rows >= 1 else NO_FIT


def keys_of(plan) -> list[str]:
    return [w.key for w, _ in plan.run]


def test_the_least_served_key_goes_first_and_turns_alternate():
    s = Scheduler(max_step_tokens=4, overhead_tokens=100)  # the latency cap does not bind
    a = [Item("a") for _ in range(6)]
    b = [Item("b") for _ in range(6)]
    s.plan([*a, *b], 100, 100)  # both keys become active at the same count
    s.charge("a", "", 10)
    plan = s.plan([*a, *b], 100, 100)
    # one row of each active key first (b, the least served, ahead), then b while it is below a's count
    assert keys_of(plan) == ["b", "a", "b", "b"]
    s.charge("b", "", 10)
    assert keys_of(s.plan([*a, *b], 100, 100)) == ["a", "b", "a", "b"]  # equal counts: one item each in turn


def test_a_key_returning_from_idle_starts_at_the_active_minimum():
    s = Scheduler(max_step_tokens=8)
    busy = [Item("busy") for _ in range(4)]
    s.plan(busy, 100, 100)
    s.charge("busy", "", 1000)
    s.plan(busy, 100, 100)
    newcomer = Item("new")
    s.plan([*busy, newcomer], 100, 100)
    assert s.served["new"] == s.served["busy"]  # no credit for having been away: it does not starve "busy"


def test_priority_classes_run_in_order_whatever_the_counts():
    s = Scheduler(max_step_tokens=3, overhead_tokens=10)  # the latency cap (12 tokens) does not bind
    batch = [Item("x", priority=Priority.BATCH) for _ in range(3)]
    rollout = [Item("y", priority=Priority.ROLLOUT) for _ in range(3)]
    interactive = Item("z", priority=Priority.INTERACTIVE)
    s.plan([*batch, *rollout, interactive], 100, 100)
    s.charge("z", "", 10_000)  # the most served key, but the top class
    plan = s.plan([*batch, *rollout, interactive], 100, 100)
    assert [w for w, _ in plan.run][:1] == [interactive] and keys_of(plan) == ["z", "y", "y"]


def test_a_long_prompt_is_chunked_to_the_step_budget():
    s = Scheduler(max_step_tokens=20)
    rows = [Item("a") for _ in range(5)]
    prompt = Item("a", pending=100, running=False, blocks=7)
    plan = s.plan([*rows, prompt], 100, 100)
    assert plan.tokens == 20 and {id(w): n for w, n in plan.run}[id(prompt)] == 15
    assert id(prompt) in plan.admit


def test_prompt_chunks_fill_max_chunk_tokens_and_decode_rows_stop_at_max_step_tokens():
    s = Scheduler(max_step_tokens=20, max_chunk_tokens=64)
    rows = [Item("a", decoding=True) for _ in range(30)]
    prompt = Item("a", pending=100, running=False, blocks=7)
    plan = s.plan([*rows, prompt], 100, 100)
    ran = {id(w): n for w, n in plan.run}
    assert sum(1 for w in rows if id(w) in ran) == 20  # decode rows: max_step_tokens
    assert ran[id(prompt)] == 44 and plan.tokens == 64  # the chunk: the rest of max_chunk_tokens
    assert s.plan(rows, 100, 100).tokens == 20
    alone = Item("b", pending=100, running=False, blocks=7)
    assert Scheduler(max_step_tokens=20, max_chunk_tokens=64).plan([alone], 100, 100).tokens == 64
    assert Scheduler(max_step_tokens=20, max_chunk_tokens=8).plan([alone], 100, 100).tokens == 20  # never below


def test_a_light_key_caps_the_step_at_max_slowdown_of_its_own_cost():
    # cost ∝ overhead + tokens: the quiet key's step alone costs 10 + 1; with slowdown 2 the step may
    # carry 2 · 11 − 10 = 12 tokens, so 11 of the flood's 100 rows run beside it.
    s = Scheduler(max_step_tokens=256, max_slowdown=2.0, overhead_tokens=10)
    flood = [Item("flood") for _ in range(100)]
    quiet = Item("quiet")
    plan = s.plan([*flood, quiet], 1000, 1000)
    assert quiet in [w for w, _ in plan.run] and plan.tokens == 12
    assert s.plan(flood, 1000, 1000).tokens == 100  # alone, the flood gets the whole budget


def test_preemption_takes_the_most_served_keys_rows_for_a_less_served_waiting_one():
    s = Scheduler(max_step_tokens=64, overhead_tokens=100)
    heavy_old = [Item("heavy", blocks=2) for _ in range(3)]
    heavy_new = [Item("heavy", blocks=2) for _ in range(2)]
    medium = [Item("medium", blocks=2)]
    waiting = Item("quiet", running=False, blocks=4)
    work = [*heavy_old, *heavy_new, *medium, waiting]
    s.plan(work, 0, 100)
    s.charge("heavy", "", 500)
    s.charge("medium", "", 100)
    plan = s.plan(work, 0, 100)  # the pool is full
    assert plan.preempt == heavy_new[::-1]  # the most served key's latest rows, just enough of them
    assert id(waiting) in plan.admit and waiting in [w for w, _ in plan.run]
    assert not set(map(id, plan.preempt)) & {id(w) for w, _ in plan.run}


def test_no_preemption_for_a_more_served_key_or_within_a_key_and_the_queue_holds_its_order():
    s = Scheduler(max_step_tokens=64, overhead_tokens=100)
    quiet_rows = [Item("quiet", blocks=2) for _ in range(2)]
    big_wait = Item("heavy", running=False, blocks=4)
    small_wait = Item("heavy", running=False, blocks=1)
    own_rows = [Item("heavy", blocks=1)]
    work = [*quiet_rows, *own_rows, big_wait, small_wait]
    s.plan(work, 0, 100)
    s.charge("heavy", "", 500)
    plan = s.plan(work, 0, 100)
    assert plan.preempt == [] and plan.admit == {}
    # a small request behind the big one does not overtake it, even with room for it
    plan = s.plan(work, 2, 100)
    assert plan.admit == {}


def test_lower_classes_are_preempted_for_a_higher_one():
    s = Scheduler(max_step_tokens=64)
    batch_rows = [Item("a", blocks=3, priority=Priority.BATCH) for _ in range(2)]
    interactive = Item("a", running=False, blocks=3, priority=Priority.INTERACTIVE)
    plan = s.plan([*batch_rows, interactive], 0, 100)
    assert len(plan.preempt) == 1 and id(interactive) in plan.admit


def test_waiting_work_whose_adapter_is_loading_is_skipped_not_blocking():
    s = Scheduler(max_step_tokens=64)
    cold = Item("a", running=False, ready=False)
    warm = Item("a", running=False)
    plan = s.plan([cold, warm], 10, 10)
    assert [w for w, _ in plan.run] == [warm]


def test_distinct_adapters_count_in_the_latency_bound():
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=2.0, cost=StepCost.linear(10.0, 1.0))
    quiet = Item("quiet", decoding=True, policy="q")
    one_policy = [Item("flood", decoding=True, policy="p") for _ in range(40)]
    many_policies = [Item("flood", decoding=True, policy=f"p{i}") for i in range(40)]
    assert len(s.plan([*one_policy, quiet], 1000, 1000).run) == len(s.plan([*many_policies, quiet], 1000, 1000).run)
    s.cost = StepCost((1, 2), (11.0, 12.0), adapter_first=2.0, adapter_each=1.5)
    same = len(s.plan([*one_policy, quiet], 1000, 1000).run)
    spread = len(s.plan([*many_policies, quiet], 1000, 1000).run)
    # quiet alone: 11 + 2 = 13, cap 26. One flood policy: 11 + k + 2 + 1.5 ≤ 26 → k = 11 more rows;
    # each flood row on its own adapter costs 2.5: 11 + k + 2 + 1.5·k ≤ 26 → k = 5.
    assert (same, spread) == (12, 6)


def test_every_running_key_gets_an_item_past_the_cap_and_decode_rows_go_before_prefill():
    """A step capped for a quiet key still carries one item of each running key (no key skips a step
    because another is protected), and a key's decode rows go before its prompts' chunks."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=64, max_slowdown=1.0, cost=StepCost.linear(10.0, 1.0))
    quiet = Item("quiet", decoding=True)
    prompt = Item("flood", pending=30, decoding=False)  # being prefilled (running), arrived first
    rows = [Item("flood", decoding=True) for _ in range(5)]
    plan = s.plan([prompt, *rows, quiet], 1000, 1000)
    assert sorted(keys_of(plan)) == ["flood", "quiet"]  # the cap (quiet alone) holds one row only
    assert [w for w, _ in plan.run if w.key == "flood"] == [rows[0]]


def test_a_capped_step_takes_the_heavy_keys_rows_on_adapters_already_in_it():
    """While a quiet key caps the step, the flood's rows beside it come from the adapter its one
    forced row brought in (and the base), not one per flood policy: each further adapter costs the
    quiet key's step its own products. Uncapped, the flood's policies take turns again."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=2.0, cost=StepCost((1, 2), (10.0, 11.0), adapter_first=2.0,
                                                                       adapter_each=3.0))
    flood = [Item("flood", decoding=True, policy=f"p{i % 4}") for i in range(40)]
    quiet = Item("quiet", decoding=True, policy="q")
    plan = s.plan([*flood, quiet], 1000, 1000)
    ran = [w for w, _ in plan.run if w.key == "flood"]
    # quiet alone: 9 + 1 + 2 = 12, cap 24. With p0 (the forced row's adapter) in the step, n rows cost
    # 9 + n + 2 + 3: 10 rows fit, 9 of them the flood's, all on p0. Taking the flood's policies in
    # turn instead (p1, p2 next: 3 more each) would carry 3 rows on 3 adapters for the same cost.
    assert len(ran) == 9 and {w.policy for w in ran} == {"p0"} and quiet in [w for w, _ in plan.run]
    alone = s.plan(flood, 1000, 1000)
    assert {w.policy for w, _ in alone.run} == {"p0", "p1", "p2", "p3"}


def test_a_protected_keys_new_request_is_planned_before_the_forced_rows_of_others():
    """A quiet key's new prompt (waiting, not yet running) is what caps the step: it is planned first,
    whole, and the flood's one forced row comes after it; were the forced row first, its adapter would
    take the slack the cap leaves and cut the quiet prompt to a partial chunk (or none)."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=1.25, cost=StepCost((1, 2), (10.0, 11.0), adapter_first=2.0,
                                                                        adapter_each=3.0))
    flood = [Item("flood", decoding=True, policy=f"p{i % 4}") for i in range(40)]
    quiet = Item("quiet", pending=5, running=False, policy="q")
    plan = s.plan([*flood, quiet], 1000, 1000)
    # quiet alone: 9 + 5 + 2 = 16, cap 20; with a flood row first (its adapter +3) 4 tokens would be left
    assert plan.run[0] == (quiet, 5) and id(quiet) in plan.admit
    assert [w.key for w, _ in plan.run[1:]] == ["flood"]  # its forced row, past the cap


def test_a_key_the_cap_leaves_no_room_for_gets_an_item_every_starve_steps():
    """A light key's closed loop caps every step; when even one item of the heavy key would break
    that cap (each on an adapter of its own, as a cold storm's), the heavy key still gets one item
    forced in after starve_steps steps without any, and the count starts again."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=1.1, cost=StepCost((1, 2), (10.0, 11.0), adapter_first=2.0,
                                                                       adapter_each=3.0))
    storm = [Item("storm", running=False, policy=f"c{i}") for i in range(20)]
    hot = Item("hot", decoding=True, policy="h")
    # hot alone: 9 + 1 + 2 = 12, cap 13.2; a storm prompt on its own adapter adds 1 + 3
    plans = [keys_of(s.plan([*storm, hot], 1000, 1000)) for _ in range(2 * s.starve_steps + 2)]
    starved = [["hot"]] * s.starve_steps
    assert plans == [*starved, ["hot", "storm"], *starved, ["hot", "storm"]]


def test_a_protected_key_lingers_after_its_work_ends():
    """A closed-loop client's next request is on its way: for linger_s after a protected key's last
    item the heavy key's steps stay capped, then they are whole again."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=2.0, cost=StepCost.linear(10.0, 1.0), linger_s=0.5)
    flood = [Item("flood", decoding=True) for _ in range(100)]
    quiet = Item("quiet", decoding=True)
    assert s.plan([*flood, quiet], 1000, 1000, now=0.0).tokens == 12
    assert s.plan(flood, 1000, 1000, now=0.1).tokens == 12  # quiet's request ended: still capped for it
    assert s.plan(flood, 1000, 1000, now=0.4).tokens == 12
    assert s.plan(flood, 1000, 1000, now=0.7).tokens == 100  # linger over
    assert Scheduler(max_step_tokens=256, max_slowdown=2.0, cost=StepCost.linear(10.0, 1.0)).plan(
        flood, 1000, 1000, now=0.1).tokens == 100  # no linger by default


def test_the_cost_curve_inverts_and_saturates():
    from mint_server.engine.scheduler import StepCost

    c = StepCost((1, 2, 4, 8, 16), (10.0, 10.5, 11.0, 14.0, 22.0), chunk=3.0)
    assert c(0, 0) == 0 and c(1, 0) == 10.0 and c(0, 4, 1) == 14.0 and c(2, 2) == 11.0
    assert c.tokens_within(9.9) == 0 and c.tokens_within(11.0) == 4 and c.tokens_within(15.0) == 9
    assert c.tokens_within(30.0) == 24  # beyond the last point: the last segment's slope
    # tokens per unit: 0.1, 0.19, 0.36, 0.57, 0.73 → 90 % of the best first reached at 16
    assert c.saturation(0.9) == 16 and c.saturation(0.75) == 8


def test_the_worker_waits_briefly_for_a_protected_key_that_comes_back_quickly():
    """Anticipation: a protected key whose requests come back within a step of its own (2 ms here,
    against its 10 ms step alone) is waited for, up to twice its typical think time, before a step
    without it starts; not while it has work, not past that, not for a key slow to come back, and
    never for the heavy key."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=1.25, cost=StepCost((1, 2), (10.0, 11.0), unit_s=0.001),
                  linger_s=1.0)
    flood = [Item("flood", decoding=True) for _ in range(100)]
    quiet, slow = Item("quiet", decoding=True), Item("slow", decoding=True)
    for t in (1.0, 2.0, 3.0):  # each key's requests: back 2, 50 and 1 ms after the last one ended
        s.note_arrival("quiet", t)
        s.note_arrival("slow", t + 0.048)
        s.note_arrival("flood", t - 0.001)
        s.plan([*flood, quiet, slow], 1000, 1000, now=t + 0.06)
        for key in ("quiet", "slow", "flood"):
            s.note_end(key, t + 0.998)
    assert s.hold(3.998, busy=set()) == pytest.approx(0.004)
    assert s.hold(4.001, busy=set()) == pytest.approx(0.001)
    assert s.hold(4.003, busy=set()) == 0.0
    assert s.hold(3.998, busy={"quiet"}) == 0.0
    s.note_arrival("quiet", 3.999)
    assert s.hold(3.999, busy=set()) == 0.0  # it is back


def test_a_keys_policies_take_turns_by_what_each_was_served():
    """Within one key, among items of the same stage, the policy served least goes first (then
    arrival): a key's policies share its turns over steps as keys share the step."""
    s = Scheduler(max_step_tokens=4, overhead_tokens=100)  # the latency cap does not bind
    a = [Item("k", decoding=True, policy="a") for _ in range(10)]
    b = [Item("k", decoding=True, policy="b") for _ in range(10)]
    assert [w.policy for w, _ in s.plan([*a, *b], 100, 100).run] == ["a"] * 4  # equal counts: arrival
    s.charge("k", "a", 8)
    assert [w.policy for w, _ in s.plan([*a, *b], 100, 100).run] == ["b"] * 4  # b, served less, first
    s.charge("k", "b", 16)
    assert [w.policy for w, _ in s.plan([*a, *b], 100, 100).run] == ["a"] * 4


def test_a_request_to_a_quiet_policy_is_not_held_behind_its_own_keys_flood():
    """One application floods 8 of its policies (25 decode rows each, every batch row taken, no KV
    free) and sends one request to a ninth: the request is admitted in the next step — a row of the
    key's most-served policy is preempted for it — and the step is capped at max_slowdown × its own
    cost, as it would be for a quiet key."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=2.0, cost=StepCost.linear(10.0, 1.0))
    flood = [Item("app", decoding=True, policy=f"p{i % 8}") for i in range(200)]
    s.plan(flood, 0, 0)
    for i in range(8):
        s.charge("app", f"p{i}", 100 + i)
    probe = Item("app", pending=8, running=False, policy="quiet")
    plan = s.plan([*flood, probe], 0, 0)
    assert plan.run[0] == (probe, 8) and id(probe) in plan.admit
    assert [w.policy for w in plan.preempt] == ["p7"]  # the most served policy's latest row
    # the probe alone: 10 + 8 = 18, cap 36; its own adapter and the step's rows: 10 + 8 + k ≤ 36
    assert plan.tokens <= 36 and len(plan.run) > 1
    assert s.plan(flood, 0, 0).tokens == 200  # without it, the flood gets the whole budget


def test_a_key_spreading_its_flood_over_policies_gains_no_protection():
    """The flows inside a key are judged against that key's heaviest flow only: a flood spread over
    40 policies, one row each, is not 40 light flows (each as heavy as the other), so a quiet key
    still caps the step and the flood is not protected against it."""
    from mint_server.engine.scheduler import StepCost

    s = Scheduler(max_step_tokens=256, max_slowdown=2.0, cost=StepCost.linear(10.0, 1.0))
    spread = [Item("flood", decoding=True, policy=f"p{i}") for i in range(40)]
    quiet = Item("quiet", decoding=True, policy="q")
    plan = s.plan([*spread, quiet], 1000, 1000)
    assert plan.run[0][0] is quiet and plan.tokens == 12  # quiet alone costs 11: the step at most 22
    assert s.plan(spread, 1000, 1000).tokens == 40
