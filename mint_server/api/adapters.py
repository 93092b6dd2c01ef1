"""Read-only adapters loaded from disk (sampler weights, reverse-KL references), kept in an LRU.

Each entry is keyed by what it was loaded from and loaded at most once at a time. A user pins an
entry for the duration of its engine call; only unpinned entries are released when the cache is
over its size, and they are simply loaded again the next time they are needed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from mint_server.engine.interface import Engine

log = logging.getLogger(__name__)
Loader = Callable[[], Awaitable[str]]


@dataclass
class _Entry:
    loading: asyncio.Future[str]
    pins: int = 0
    doomed: bool = False  # its source is gone: release as soon as no one uses it


class AdapterCache:
    def __init__(self, engine: Engine, capacity: int, on_change: Callable[[int], None]) -> None:
        self._engine = engine
        self._capacity = max(1, capacity)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._on_change = on_change
        self._releasing: set[asyncio.Task[None]] = set()  # strong refs: the loop keeps tasks weakly

    def __len__(self) -> int:
        return len(self._entries)

    @asynccontextmanager
    async def use(self, key: str, loader: Loader) -> AsyncIterator[str]:
        """The adapter id for `key`, loading it if needed, pinned until the block exits."""
        entry = self._entries.get(key)
        if entry is None or (entry.loading.done() and entry.loading.exception() is not None):
            entry = _Entry(asyncio.ensure_future(loader()))
            self._entries[key] = entry
            self._on_change(len(self._entries))
        self._entries.move_to_end(key)
        entry.pins += 1
        try:
            try:
                adapter_id = await asyncio.shield(entry.loading)
            except Exception:
                if self._entries.get(key) is entry:  # a failed load must not stay cached
                    del self._entries[key]
                    self._on_change(len(self._entries))
                raise
            yield adapter_id
        finally:
            entry.pins -= 1
            if entry.doomed and entry.pins == 0:
                await self._release(entry)
            self._evict()

    def forget(self, key: str) -> None:
        """The source is gone (checkpoint deleted, session ended): release once unused."""
        entry = self._entries.pop(key, None)
        self._on_change(len(self._entries))
        if entry is not None:
            entry.doomed = True
            if entry.pins == 0:
                task = asyncio.ensure_future(self._release(entry))
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)

    def forget_prefix(self, prefix: str) -> None:
        for key in [k for k in self._entries if k.startswith(prefix)]:
            self.forget(key)

    def _evict(self) -> None:
        for key in list(self._entries):
            if len(self._entries) <= self._capacity:
                break
            entry = self._entries[key]
            if entry.pins == 0 and entry.loading.done():
                self.forget(key)

    async def _release(self, entry: _Entry) -> None:
        if not entry.loading.done() or entry.loading.exception() is not None:
            return
        try:
            await asyncio.wrap_future(self._engine.release_adapter(entry.loading.result()))
        except Exception:
            log.exception("releasing an adapter failed")
