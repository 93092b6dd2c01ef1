"""Which sample requests read and fill the prefix cache, and under which keys (docs/engine.md "Prefix
cache"; the cache itself is the block pool's, kv.py).

A prompt's full KV blocks are kept under a hash chain whose root names the base, the adapter
revision's content and the salt (whose blocks a request may read); a later prompt with the same
prefix takes the blocks it finds there and starts its prefill after them.
"""

from __future__ import annotations

import logging

from mint_server.engine.kv import BlockPool, block_keys, cache_root
from mint_server.engine.sample_request import PromptGroup, SampleRequest, SampleRow
from mint_server.engine.values import REVISION_KEY_PREFIX
from mint_server.model.families import family_spec
from mint_server.model.transformer import Transformer

log = logging.getLogger(__name__)


class PrefixKeys:
    def __init__(self, model: Transformer, block_size: int, wanted: bool, salt_per_owner: bool) -> None:
        """wanted: keep full KV blocks for later requests with the same prefix (off on hybrid and
        vision bases, whose state is not all in blocks: `off_reason` says why); salt_per_owner: only
        a request of the same key (owner) reads them, or joins a prompt being prefilled."""
        self.block_size, self.salt_per_owner = block_size, salt_per_owner
        self.off_reason = "" if wanted else "off by setting"
        if wanted and (refusal := family_spec(model.config).prefix_cache_refusal):
            self.off_reason = refusal  # a hybrid base: its recurrent state is not in the KV blocks
        elif wanted and getattr(model, "vision_input", None) is not None:
            self.off_reason = "a vision base: a prompt's image features are not in its tokens"
        self.on = wanted and not self.off_reason
        if wanted and self.off_reason:
            log.info("prefix cache off: %s", self.off_reason)

    def salt(self, req: SampleRequest) -> str:
        """Whose cached blocks (and prompts being prefilled) a request may read: its owner's only."""
        return req.key if self.on and self.salt_per_owner else ""

    def prefix(self, req: SampleRequest) -> tuple[bytes | None, list[bytes]]:
        """The root of its blocks' key chain (None: it neither reads nor fills the cache) and the keys
        of its prompt's full blocks. The root names the base (one per sampler), the adapter revision's
        content — a catalog revision by its content key, any other read-only adapter by its id (its
        weights never change); a trainable adapter's weights change with every step, so it caches
        nothing — and the salt."""
        if req.prefix is None:
            a, root = req.adapter, None
            if self.on and req.job.images is None and (a is None or not a.trainable):
                content = "base" if a is None else (
                    a.source.key if a.source is not None and a.source.key.startswith(REVISION_KEY_PREFIX)
                    else "adapter:" + a.id)
                root = cache_root("mint-kv-1", content, self.salt(req))
            keys = [] if root is None else block_keys(root, req.prompt, self.block_size)
            req.prefix = (root, keys)
        return req.prefix

    def usable_blocks(self, req: SampleRequest) -> int:
        """How many leading full prompt blocks a new prompt row for `req` may take from the cache:
        the last prompt position is always computed (its logits draw the first token), and so is every
        position whose prompt logprob, targets or draws it asks for."""
        limit = len(req.prompt) - 1
        if req.job.prompt_extras:
            limit = 0
        elif req.wants_scores:
            limit = min(limit, max(0, req.job.score_from))
        return limit // self.block_size

    def hit_tokens(self, req: SampleRequest, pool: BlockPool) -> int:
        """Prompt positions a new prompt row for `req` would take from the cache now."""
        if not self.on:
            return 0
        _, keys = self.prefix(req)
        return len(pool.lookup(keys[: self.usable_blocks(req)])) * self.block_size

    def register(self, item: SampleRow | PromptGroup, pool: BlockPool) -> None:
        """Keep the full blocks it has computed since the last call under their keys."""
        bs = self.block_size
        if isinstance(item, PromptGroup):
            if item.root is None:
                return
            upto = min(item.computed // bs, len(item.keys))
            for k in range(item.registered, upto):
                pool.register(item.keys[k], item.blocks[k])
            item.registered = max(item.registered, upto)
        elif item.keys is not None and item.length % bs == 0 and item.length // bs == len(item.keys) + 1:
            k, n = len(item.keys), len(item.request.prompt)
            seq = item.request.prompt[k * bs :] + tuple(item.tokens[max(0, k * bs - n) :])
            item.keys += block_keys(item.keys[-1] if item.keys else item.root, seq[:bs], bs)
            pool.register(item.keys[k], item.blocks[k])
