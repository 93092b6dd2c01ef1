"""Which sampling session recorded which sequences (`record_stability_info`), so that training with
`stable_reinforce` reads only records of its own key's live sessions."""

from __future__ import annotations

from tinker import types

from mint_server.api.tinker.validate import InvalidInput

MAX_RECORDED = 1_000_000  # sample requests whose recorded sequences are tracked for scoping


class RecordedSequences:
    def __init__(self) -> None:
        # id prefix "seq-<run>" → (owner, sampler id); None once that sampler's session ended (its
        # records are then expired for training).
        self._by_prefix: dict[str, tuple[str, str] | None] = {}

    def note(self, prefix: str, owner: str, sampler_id: str) -> None:
        self._by_prefix[prefix] = (owner, sampler_id)
        while len(self._by_prefix) > MAX_RECORDED:  # oldest first: the engine's records expire long before
            del self._by_prefix[next(iter(self._by_prefix))]

    def expire(self, prefixes: list[str]) -> None:
        """The session that recorded these is over: its records are expired for training."""
        for prefix in prefixes:
            if prefix in self._by_prefix:
                self._by_prefix[prefix] = None

    def check(self, data: list[types.Datum], owner: str, live_samplers: dict[str, object]) -> None:
        """stable_reinforce may only read records of sequences `owner`'s live sampling sessions made.

        Records are session-scoped: once the sampler's session is gone its records are expired, and
        another key's are unknown; both are a 400 naming the id. Ids never recorded are left to the
        engine (it uses the datum's own logprobs, or refuses naming the id).
        """
        for i, d in enumerate(data):
            for span in d.loss_fn_input_spans or ():
                if not isinstance(span, types.SampledProvenanceSpan):
                    continue
                prefix = span.sequence_id.rsplit("-", 1)[0]
                if prefix not in self._by_prefix:
                    continue
                who = self._by_prefix[prefix]
                if who is None or who[0] != owner or who[1] not in live_samplers:
                    raise InvalidInput(
                        f"datums[{i}].loss_fn_input_spans: sequence_id {span.sequence_id!r} is unknown or "
                        "expired (its sampling session ended, or it is not yours)"
                    )
