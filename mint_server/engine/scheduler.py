"""The scheduler: every engine step, turn the sampler's queues into a step plan. Pure policy.

No tensors and no model here: the sampler (the executor) describes its work as `Work` items —
running sequences that hold KV and waiting ones that do not — and gets back a `StepPlan`: which
items run how many tokens this step (a decode row one, a prefill a chunk of its prompt), which
waiting items to admit (reserve KV for), and which running items to preempt first (free their KV and
requeue them; they are recomputed when readmitted). The sampler runs the plan as one forward over a
ragged batch and reports what each key was served with `charge`.

Policy, in order:
1. **Priorities.** Lower `priority` first (interactive < rollout < batch): a class's work is planned
   before any of the next class's.
2. **Fair shares** (virtual token counters, after "Fairness in Serving LLMs"): within a class every
   key the latency cap below protects first gets one item (its new request too), then every other
   key with running work one (a decode row or a prefill chunk; within the budget but past the cap),
   so no active key skips a step and none of those forced items crowds out the work the step is
   capped for; then the key with the fewest tokens
   served goes next, one item at a time, counting the tokens planned in this step, so a key with one
   request gets its turn whatever another key queues. Within a key: a quiet policy's request first (see
   4.: one application's request to a quiet policy does not queue behind its own flood to its other
   policies), then decode rows, then prompts being prefilled, then waiting requests; among those the
   policy (adapter) served least, then arrival. A key that becomes active starts at the least count
   among the active keys (no credit hoarded while idle). A key whose ready work no step has taken
   for `starve_steps` steps in a row (the latency cap below left no room for it) gets one item
   forced into the next: a light key's closed loop never starves the others.
3. **Budget.** A step runs at most `max_step_tokens` decode rows and, in all, at most
   `max_chunk_tokens` tokens (no fewer than `max_step_tokens`): prompt tokens reach their best
   throughput in bigger chunks than decode rows do, since a chunk yields one row's logits and draw
   where each decode row yields its own. A prompt longer than what is left is prefilled in chunks
   over several steps (chunked prefill), beside everyone's decode rows.
4. **Latency bound.** A step's cost follows the tokens it runs (`StepCost`, measured at start-up: a
   curve, since a few tokens cost more per token than many, plus a prefill chunk's and the adapters'
   own cost). While a light key (cheaper work than the heaviest) or a higher priority class has work
   in the step, the step is capped so it costs at most `max_slowdown` × what that work alone would
   cost: a quiet key's 8-token request is not stuck in 200-row steps of a flood (nor a key's request
   to a quiet policy — less than half the mean demand of the key's other policies — in that key's own
   flood); the flood gets the
   rest of the budget, and all of it when the quiet key is gone — `linger_s` after it is gone, since
   a closed-loop client's next request is usually on its way. In such a capped step a key's next item
   is, within its turn's stage, one on an adapter already in the step where it has one (a further
   adapter costs the step its own products). A protected key that usually comes back within a step
   of its own is waited for, briefly, before a step without it starts (`hold`: anticipation).
5. **Admission and preemption.** Waiting work is admitted when its KV blocks and rows fit. When they
   do not and running items of more-served keys (or of a lower class; or, for a policy of the key
   that holds no KV yet, of the key's more-served policies) hold KV, the most-served of those are
   preempted until it fits. The first waiting item that cannot be admitted even so stops
   admission for the step, so a large request is never starved by a stream of small ones.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Fit:
    """What admitting a waiting item now would take: `take` of its samples (0: it does not fit),
    the KV blocks and batch rows they reserve, and whether that is all of them."""

    take: int
    blocks: int = 0
    rows: int = 0
    complete: bool = True


NO_FIT = Fit(0, complete=False)


class Work(Protocol):
    """What the scheduler reads of one unit of sample work (the sampler's rows and prompt groups)."""

    key: str  # the API key whose work it is
    policy: str  # its adapter ("" for the base)
    priority: int  # lower first
    arrival: int  # submission order
    running: bool  # holds KV blocks (else waiting)
    decoding: bool  # a decode row (one token, its logits and its draw), else prefill tokens

    @property
    def pending(self) -> int:
        """Tokens it still has to run before it yields its next logits (1 for a decode row)."""
        ...

    @property
    def ready(self) -> bool:
        """Its adapter is in a device slot (waiting work that is not ready is skipped)."""
        ...

    @property
    def preemptible(self) -> bool: ...

    @property
    def held_blocks(self) -> int:
        """KV blocks freed if it is preempted."""
        ...

    @property
    def held_rows(self) -> int: ...

    def fit(self, free_blocks: int, free_rows: int) -> Fit:
        """What admitting it with this much room would take."""
        ...


@dataclass
class StepPlan:
    run: list[tuple[Work, int]] = field(default_factory=list)  # (item, tokens this step), in plan order
    admit: dict[int, Fit] = field(default_factory=dict)  # id(item) → what it takes (admitted this step)
    preempt: list[Work] = field(default_factory=list)  # running items to preempt before the step

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.run)


@dataclass(frozen=True)
class StepCost:
    """A step's cost in units of `unit_s` seconds, by the tokens it runs — decode rows and prefill
    tokens alike, since every projection runs once over all of them: `cost[i]` for a step of
    `tokens[i]` tokens (measured at start-up: a few tokens cost more per token than many, and on
    CPUs the row counts where BLAS changes method show), linear between the points and beyond the
    last; plus `chunk` per prefill chunk (its own attention call in every layer) and, for decode rows,
    what drawing their tokens costs, which the measurement includes. An empty step costs nothing."""

    tokens: tuple[int, ...] = (1, 2)
    cost: tuple[float, ...] = (1.0, 2.0)
    chunk: float = 0.0
    # LoRA: the first adapter in a step (its products in every layer), and each further distinct one
    adapter_first: float = 0.0
    adapter_each: float = 0.0
    unit_s: float = 0.0  # seconds of one unit on this machine (0: unknown)

    @classmethod
    def linear(cls, overhead: float, per_token: float = 1.0) -> StepCost:
        """overhead + per_token × tokens."""
        return cls((1, 2), (overhead + per_token, overhead + 2 * per_token))

    def _segment(self, n: float) -> tuple[int, int, float, float]:
        xs, ys = self.tokens, self.cost
        i = max(1, min(len(xs) - 1, next((j for j, x in enumerate(xs) if x >= n), len(xs) - 1)))
        return xs[i - 1], xs[i], ys[i - 1], ys[i]

    def at(self, n: float) -> float:
        """The cost of a step of n tokens (n ≥ 1), interpolated."""
        x0, x1, y0, y1 = self._segment(n)
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def __call__(self, rows: int, tokens: int, chunks: int = 0, adapters: int = 0) -> float:
        n = rows + tokens
        return (self.at(n) if n else 0.0) + self.chunk * chunks + self.lora(adapters)

    def lora(self, adapters: int) -> float:
        """What `adapters` distinct adapters add to a step."""
        return self.adapter_first + self.adapter_each * (adapters - 1) if adapters > 0 else 0.0

    def tokens_within(self, budget: float) -> int:
        """The most tokens a step may run for at most `budget` (0 if not even one)."""
        if budget < self.at(1):
            return 0
        lo, hi = 1, 2
        while self.at(hi) <= budget:
            lo, hi = hi, hi * 2
            if hi > 1 << 30:
                return lo
        while hi - lo > 1:  # at() is increasing: the boundary lies in [lo, hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.at(mid) <= budget else (lo, mid)
        return lo

    def saturation(self, share: float = 0.9) -> int:
        """The fewest measured tokens per step that reach `share` of the best measured tokens per
        second: bigger steps gain little throughput, and everything arriving meanwhile waits them out."""
        rates = [n / c for n, c in zip(self.tokens, self.cost, strict=True) if c > 0]
        best = max(rates, default=0.0)
        return next((n for n, r in zip(self.tokens, rates, strict=False) if r >= share * best), self.tokens[-1])


@dataclass
class Scheduler:
    max_step_tokens: int
    max_slowdown: float = 2.0
    max_chunk_tokens: int = 0  # a step's tokens with prompt chunks in it (below max_step_tokens: that)
    overhead_tokens: int = 0  # the cost model when `cost` is not given: StepCost.linear(overhead_tokens)
    cost: StepCost | None = None
    served: dict[str, float] = field(default_factory=dict)  # key → tokens served (virtual counter)
    served_policy: dict[tuple[str, str], float] = field(default_factory=dict)
    tokens_by_key: dict[str, float] = field(default_factory=dict)  # what each key was actually served
    # A protected key whose work just ended stays protected this long (seconds): a closed-loop client's
    # next request (a chat turn, an SDK loop) is on its way, and would otherwise arrive to find a full
    # step of the heavy key's in flight and wait it out.
    linger_s: float = 0.0
    # Steps in a row a key's ready work may go untaken before one item of it is forced into a step
    # (aging): a cap tight enough that no item of the heavy key fits must not starve it.
    starve_steps: int = 8
    _active: set[str] = field(default_factory=set)
    _untaken: dict[str, int] = field(default_factory=dict)  # key → steps in a row none of its ready work ran
    _protected: dict[tuple[int, str], float] = field(default_factory=dict)  # (class, key) → its cost alone
    _lingering: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)  # → (until, cost)
    _active_policies: set[tuple[str, str]] = field(default_factory=set)
    _ended: dict[str, float] = field(default_factory=dict)  # key → when its latest request ended
    _returns: dict[str, deque[float]] = field(default_factory=dict)  # key → its latest think times

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = StepCost.linear(self.overhead_tokens)

    def charge(self, key: str, policy: str, tokens: float) -> None:
        """Count tokens served to a key (and its policy): prefill, decode or training."""
        self.served[key] = self.served.get(key, 0.0) + tokens
        self.tokens_by_key[key] = self.tokens_by_key.get(key, 0.0) + tokens
        self.served_policy[key, policy] = self.served_policy.get((key, policy), 0.0) + tokens

    def shares(self) -> dict[str, float]:
        """Tokens served per key since start (for /metrics)."""
        return dict(self.tokens_by_key)

    def plan(self, work: Sequence[Work], free_blocks: int, free_rows: int, now: float | None = None) -> StepPlan:
        """The next step's plan; `now` (seconds, any monotonic clock) lets recently protected keys
        linger (linger_s)."""
        plan = StepPlan()
        self._activate(work)
        candidates = [w for w in work if w.running or w.ready]
        if not candidates:
            return plan
        tokens_left = self.step_budget
        allowed, protected, light_flows = self._cap(candidates, now)  # the step's cost bound (StepCost units)
        capped = not math.isinf(allowed)
        rows = tokens = chunks = 0  # decode rows, prefill tokens and prefill chunks planned so far
        policies: set[str] = set()  # distinct adapters planned so far
        planned: dict[str, float] = {}
        preempted: set[int] = set()
        admitting = True
        for cls in sorted({w.priority for w in candidates}):
            light = {(k, p) for c, k, p in light_flows if c == cls}
            queues = self._queues((w for w in candidates if w.priority == cls), light)
            # First one item of each protected key, and of each key with a light policy (that policy's
            # item: its queue starts with it) — the step is capped for their work: it must not be
            # crowded out by the forced items below —, then one running item of every other key
            # (least served first): no active key skips a step.
            first = deque(sorted((k for k, q in queues.items() if (cls, k) in protected or q[0].running
                                  or (k, q[0].policy) in light or self._untaken.get(k, 0) >= self.starve_steps),
                                 key=lambda k: ((cls, k) not in protected and (k, queues[k][0].policy) not in light,
                                                self.served.get(k, 0.0), k)))
            share = max(1, tokens_left // len(queues))  # a forced item's most: the others' turns must fit too
            while queues and tokens_left >= 1 and (first or self._room(rows, tokens, chunks, len(policies), allowed, True) >= 1
                                                   or self._room(rows, tokens, chunks, len(policies), allowed, False) >= 1):
                forced = bool(first)  # a running key's one item per step: within the budget, past the latency cap
                if first:
                    key = first.popleft()
                else:
                    key = min(queues, key=lambda k: (self.served.get(k, 0.0) + planned.get(k, 0.0), k))
                item = self._take(queues[key], policies) if capped else queues[key].pop(0)
                if not queues[key]:
                    del queues[key]
                adapters = len(policies) + (1 if item.policy and item.policy not in policies else 0)
                room = max(self._room(rows, tokens, chunks, adapters, allowed, item.decoding), int(forced))
                if id(item) in preempted or room < 1 or (item.decoding and rows >= self.max_step_tokens):
                    continue
                if not item.running:
                    if not admitting:
                        continue
                    fit = item.fit(free_blocks, free_rows)
                    if fit.take == 0:
                        victims = self._victims(item, work, preempted, free_blocks, free_rows)
                        if victims is None:
                            admitting = False  # nothing smaller overtakes it this step
                            continue
                        for v in victims:
                            preempted.add(id(v))
                            plan.preempt.append(v)
                            free_blocks += v.held_blocks
                            free_rows += v.held_rows
                        for w, n in plan.run:
                            if id(w) in preempted:
                                rows, tokens, chunks = (rows - 1, tokens, chunks) if w.decoding else \
                                    (rows, tokens - n, chunks - 1)
                                tokens_left += n
                                planned[w.key] -= n
                        plan.run = [(w, n) for w, n in plan.run if id(w) not in preempted]
                        policies = {w.policy for w, _ in plan.run if w.policy}
                        adapters = len(policies) + (1 if item.policy and item.policy not in policies else 0)
                        fit = item.fit(free_blocks, free_rows)
                    plan.admit[id(item)] = fit
                    free_blocks -= fit.blocks
                    free_rows -= fit.rows
                    admitting = fit.complete
                n = min(item.pending, tokens_left, room, share if forced else tokens_left)  # ≥ 1
                plan.run.append((item, n))
                if item.policy:
                    policies.add(item.policy)
                rows, tokens, chunks = (rows + 1, tokens, chunks) if item.decoding else (rows, tokens + n, chunks + 1)
                tokens_left -= n
                planned[key] = planned.get(key, 0.0) + n
        self._untaken = {k: 0 if k in planned else self._untaken.get(k, 0) + 1 for k in {w.key for w in candidates}}
        return plan

    @property
    def step_budget(self) -> int:
        """The most tokens one step runs, prompt chunks included."""
        return max(self.max_step_tokens, self.max_chunk_tokens)

    # --- helpers ------------------------------------------------------------------------------
    def _activate(self, work: Sequence[Work]) -> None:
        """Virtual-counter lift: a key (or a key's policy) that (re)appears starts at the least count
        among the active ones, so nobody hoards credit while idle."""
        keys = {w.key for w in work}
        policies = {(w.key, w.policy) for w in work}
        staying = self._active & keys
        if staying:
            floor = min(self.served.get(k, 0.0) for k in staying)
            for k in keys - staying:
                self.served[k] = max(self.served.get(k, 0.0), floor)
        staying_p = self._active_policies & policies
        for kp in policies - staying_p:
            peers = [self.served_policy.get(p, 0.0) for p in staying_p if p[0] == kp[0]]
            if peers:
                self.served_policy[kp] = max(self.served_policy.get(kp, 0.0), min(peers))
        self._active, self._active_policies = keys, policies
        if len(self.served_policy) > 4 * len(policies) + 1024:  # forget idle ones (lifted on return)
            self.served = {k: v for k, v in self.served.items() if k in keys}
            self.served_policy = {kp: v for kp, v in self.served_policy.items() if kp in policies}

    def _queues(self, items: Iterable[Work], light: set[tuple[str, str]]) -> dict[str, list[Work]]:
        """Per key, its items in order: a light policy's first (a quiet policy of a key that floods its
        others: see _cap), then decode rows, then prompts being prefilled (both hold KV; a running
        stream's next token before a new request's first), then waiting work; within each the policy
        served least, then arrival."""
        out: dict[str, list[Work]] = {}
        for w in items:
            out.setdefault(w.key, []).append(w)
        for key, q in out.items():
            q.sort(key=lambda w: ((key, w.policy) not in light, not w.running, not w.decoding,
                                  self.served_policy.get((key, w.policy), 0.0), w.arrival))
        return out

    @staticmethod
    def _take(queue: list[Work], policies: set[str]) -> Work:
        """A key's next item in a capped step: among the items of its turn's stage (decode rows, prompts
        being prefilled, waiting work), the first on the base or on an adapter already in the step, else
        the first. Every further adapter costs the step its own products — on CPUs its launches, ~5 ms an
        adapter on SmolLM2 — which the protected key's steps would pay."""
        stage = (queue[0].running, queue[0].decoding)
        for i, w in enumerate(queue):
            if (w.running, w.decoding) != stage:
                break
            if not w.policy or w.policy in policies:
                return queue.pop(i)
        return queue.pop(0)

    def _room(self, rows: int, tokens: int, chunks: int, adapters: int, allowed: float, decoding: bool) -> int:
        """How many tokens one more item may run within `allowed` (with `adapters` distinct adapters
        in the step once it is in): a decode row its one or none, a prefill chunk the tokens that fit."""
        assert self.cost is not None
        if decoding:
            return 1 if self.cost(rows + 1, tokens, chunks, adapters) <= allowed else 0
        if math.isinf(allowed):
            return self.step_budget
        budget = allowed - self.cost.lora(adapters) - self.cost.chunk * (chunks + 1)
        return max(0, self.cost.tokens_within(budget) - rows - tokens)

    def _cap(self, items: Sequence[Work], now: float | None = None
             ) -> tuple[float, set[tuple[int, str]], set[tuple[int, str, str]]]:
        """The latency bound (4. above): the most a step may cost given who is in it (and who just
        left, within linger_s); the (class, key)s it protects; and the light flows it protects inside
        a key — a (class, key, policy) with less than half the mean demand of its key's other policies,
        so one application's request to a quiet policy is not held in the steps of its own flood."""
        demand: dict[tuple[int, str, str], tuple[int, int, int]] = {}  # flow → (rows, prefill tokens, chunks)
        for w in items:
            r, t, c = demand.get((w.priority, w.key, w.policy), (0, 0, 0))
            demand[w.priority, w.key, w.policy] = (r + 1, t, c) if w.decoding else \
                (r, t + min(w.pending, self.step_budget), c + 1)
        by_key: dict[tuple[int, str], list[tuple[int, str, str]]] = {}
        for flow in demand:
            by_key.setdefault(flow[:2], []).append(flow)
        assert self.cost is not None

        def cost_of(flows: Iterable[tuple[int, str, str]]) -> float:
            flows = list(flows)
            total = [sum(demand[f][i] for f in flows) for i in range(3)]
            return self.cost(*total, len({f[2] for f in flows if f[2]}))  # type: ignore[misc]

        costs = {k: cost_of(flows) for k, flows in by_key.items()}
        top = min(p for p, _ in costs)
        heaviest = max(costs.values())
        lower_classes = any(p > top for p, _ in costs)
        protected = [k for k, c in costs.items() if c < heaviest or (lower_classes and k[0] == top)]
        light: dict[tuple[int, str, str], float] = {}
        for k, flows in by_key.items():
            if k in protected or len(flows) < 2:
                continue
            # Light: less than half the mean demand of the key's other policies (tokens to run). A policy
            # only a little lighter than its siblings is not protected: capping a key's steps for it
            # would cut the key's own throughput for no latency it would notice.
            tokens = {f: demand[f][0] + demand[f][1] for f in flows}
            total = sum(tokens.values())
            light.update({f: cost_of([f]) for f in flows
                          if 2 * tokens[f] * (len(flows) - 1) < total - tokens[f]})
        lingering = self._linger(now, costs, {k: costs[k] for k in protected})
        bounds = [self.max_slowdown * costs[k] for k in protected] + [self.max_slowdown * c for c in light.values()]
        bounds += [self.max_slowdown * c for k, c in lingering.items() if k[0] <= top and c < heaviest]
        if not bounds:
            return math.inf, set(), set()
        together = cost_of([f for k in protected for f in by_key[k]] + list(light))
        return max(min(bounds), together), set(protected), set(light)

    def note_end(self, key: str, now: float) -> None:
        """A request of `key` ended (its response is on its way)."""
        self._ended[key] = now
        if len(self._ended) > 4096:  # keys that never came back
            self._ended = dict(sorted(self._ended.items(), key=lambda kv: kv[1])[-1024:])

    def note_arrival(self, key: str, now: float) -> None:
        """A request of `key` arrived: the time since its previous one ended is its think time."""
        ended = self._ended.pop(key, None)
        if ended is not None:
            self._returns.setdefault(key, deque(maxlen=8)).append(max(0.0, now - ended))
            if len(self._returns) > 4096:
                self._returns = {k: v for k, v in self._returns.items() if k in self._ended or k == key}

    def hold(self, now: float, busy: set[str]) -> float:
        """Seconds to wait before the next step for a protected key whose request just ended and
        which usually comes back sooner than a step of its own takes (anticipation, as disk
        schedulers wait for a process's next read): a step started just before its next request
        arrives is one it waits out whole, where this wait costs the heavy keys at most that one
        step's time. 0 when no such key is idle (keys in `busy` have work queued or running)."""
        assert self.cost is not None
        if self.cost.unit_s <= 0:
            return 0.0
        costs = {key: cost for (_, key), cost in self._protected.items()}
        costs.update({key: cost for (_, key), (until, cost) in self._lingering.items() if until > now})
        wait = 0.0
        for key, cost in costs.items():
            ended, returns = self._ended.get(key), self._returns.get(key)
            if key in busy or ended is None or not returns:
                continue
            typical, own = sorted(returns)[len(returns) // 2], cost * self.cost.unit_s
            if typical <= own:
                wait = max(wait, ended + min(2 * typical, own) - now)
        return wait

    def lingering(self, now: float) -> set[str]:
        """The keys the last step protected, and those it would still protect for a while though
        their work is gone (linger_s): the ones whose work may have just ended, or soon comes back."""
        return {key for _, key in self._protected} | {key for (_, key), (until, _) in self._lingering.items()
                                                       if until > now}

    def _linger(self, now: float | None, present: Collection[tuple[int, str]],
                protected: dict[tuple[int, str], float]) -> dict[tuple[int, str], float]:
        """Keys protected last step whose work is gone now linger, with their cost alone, until
        linger_s has passed (or they come back); returns the ones still lingering."""
        if now is None or self.linger_s <= 0:
            self._protected, self._lingering = {}, {}
            return {}
        for k, cost in self._protected.items():
            if k not in present:
                self._lingering[k] = (now + self.linger_s, cost)
        self._lingering = {k: v for k, v in self._lingering.items() if v[0] > now and k not in present}
        self._protected = protected
        return {k: cost for k, (_, cost) in self._lingering.items()}

    def _victims(self, item: Work, work: Sequence[Work], preempted: set[int], free_blocks: int,
                 free_rows: int) -> list[Work] | None:
        """Running items to preempt so `item` fits: of lower classes, of more-served keys, or — for a
        policy of its key that holds no KV yet — of the same key's more-served policies; the least
        entitled first (lowest class, most served, latest arrival); None if that cannot make room."""
        mine = self.served.get(item.key, 0.0)
        rows: dict[str, int] = {}  # batch rows each key holds (a prompt being prefilled: its samples')
        for w in work:
            if w.running:
                rows[w.key] = rows.get(w.key, 0) + max(1, w.held_rows)
        flow = (item.key, item.policy)
        new_flow = not any(w.running and (w.key, w.policy) == flow for w in work)
        mine_flow = self.served_policy.get(flow, 0.0)

        def ahead(w: Work) -> bool:  # served more, or as much (a key that just arrived) with more rows
            if w.key == item.key:
                return new_flow and w.policy != item.policy and self.served_policy.get((w.key, w.policy), 0.0) > mine_flow
            theirs = self.served.get(w.key, 0.0)
            return theirs > mine or (theirs == mine and rows.get(w.key, 0) > rows.get(item.key, 0) + 1)

        pool = [w for w in work if w.running and w.preemptible and id(w) not in preempted
                and (w.priority > item.priority or (w.priority == item.priority and ahead(w)))]
        pool.sort(key=lambda w: (-w.priority, -self.served.get(w.key, 0.0),
                                 -self.served_policy.get((w.key, w.policy), 0.0), -rows.get(w.key, 0), -w.arrival))
        chosen: list[Work] = []
        for w in pool:
            chosen.append(w)
            free_blocks += w.held_blocks
            free_rows += w.held_rows
            if item.fit(free_blocks, free_rows).take > 0:
                return chosen
        return None
