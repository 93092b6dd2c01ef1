"""Paused sampling targets, per owner: a policy (every sampling session reading it) or one sampling
session. An asynchronous RL trainer pauses generation, moves the alias or loads a new revision,
and resumes (SGLang's pause / continue). While a target is paused its new sample requests are
accepted and wait here, before the engine: the SDK polls them as queued work, as it does any
request still in the queue. Requests already in the engine are not touched: they finish on the
revision their session pinned. A pause that is never resumed ends by itself at its deadline, so a
trainer that dies mid-pause does not hold its samplers forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

Target = tuple[str, str]  # ("policy", NAME) or ("session", SAMPLING_SESSION_ID)
TARGET_KINDS = ("policy", "session")
DEFAULT_PAUSE_S = 300.0  # a pause without a timeout ends after this
MAX_PAUSE_S = 3600.0
MAX_PAUSES_PER_OWNER = 1024  # pauses are cheap, but not unbounded


@dataclass
class Pause:
    until: float  # time.monotonic() deadline
    released: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0  # requests waiting on it now


class PauseBoard:
    def __init__(self) -> None:
        self._pauses: dict[tuple[str, str, str], Pause] = {}  # (owner, kind, name) → its pause

    def pause(self, owner: str, target: Target, timeout_s: float) -> None:
        """Pause `target` for at most `timeout_s` seconds (a repeated pause moves the deadline)."""
        self._expire()
        key = (owner, *target)
        until = time.monotonic() + timeout_s
        if (current := self._pauses.get(key)) is not None:
            current.until = until
        else:
            self._pauses[key] = Pause(until)

    def full(self, owner: str, target: Target) -> bool:
        """Whether pausing `target` would pass MAX_PAUSES_PER_OWNER (pausing it again never does)."""
        self._expire()
        return (owner, *target) not in self._pauses and \
            sum(k[0] == owner for k in self._pauses) >= MAX_PAUSES_PER_OWNER

    def resume(self, owner: str, target: Target) -> None:
        """Release `target`'s waiting requests (a target not paused: nothing to do)."""
        if (pause := self._pauses.pop((owner, *target), None)) is not None:
            pause.released.set()

    def paused(self, owner: str) -> list[dict[str, object]]:
        self._expire()
        now = time.monotonic()
        return [{"kind": kind, "name": name, "remaining_s": round(p.until - now, 3), "held": p.held}
                for (o, kind, name), p in sorted(self._pauses.items()) if o == owner]  # fmt: skip

    async def wait(self, owner: str, targets: Iterable[Target]) -> None:
        """Return once none of `targets` is paused (resumed, or past its deadline)."""
        targets = list(targets)
        while True:
            pause = next((p for t in targets if (p := self._pauses.get((owner, *t))) is not None), None)
            if pause is None:
                return
            left = pause.until - time.monotonic()
            if left > 0:
                pause.held += 1
                try:
                    with contextlib.suppress(TimeoutError):  # its deadline: _expire ends it
                        await asyncio.wait_for(pause.released.wait(), timeout=left)
                finally:
                    pause.held -= 1
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self._pauses.items() if p.until <= now]:
            self._pauses.pop(key).released.set()
