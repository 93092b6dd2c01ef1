"""Evals: metric values attached to revisions."""

from __future__ import annotations

import math

from sqlalchemy import select

from mint_server.catalog import cursor as cursors
from mint_server.catalog.core import CatalogCore, now, page_of
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.fields import check_text
from mint_server.catalog.records import EvalRecord, Page
from mint_server.catalog.refs import check_owner, parse_ref
from mint_server.catalog.schema import EvalRow


class Evals(CatalogCore):
    # -- evals ----------------------------------------------------------------------------
    def record_eval(
        self, owner: str, ref: str, metric: str, value: float, *, dataset: str | None = None
    ) -> EvalRecord:
        """Attach a metric value to the revision `ref` names."""
        (record,) = self.record_evals(owner, [(ref, value)], metric, dataset=dataset)
        return record

    def record_evals(
        self, owner: str, values: list[tuple[str, float]], metric: str, *, dataset: str | None = None
    ) -> list[EvalRecord]:
        """Attach one metric to many revisions ((ref, value) pairs) in one transaction: all or none."""
        check_owner(owner)
        metric = check_text(metric, "metric", 128, required=True)
        dataset = check_text(dataset, "dataset", 256)
        parsed = [(parse_ref(ref), ref, value) for ref, value in values]
        for _, _, value in parsed:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidArgument(f"value must be a finite number, got {value!r}", field="value")
        out = []
        with self._write() as s:
            for ref, text_ref, value in parsed:
                revision = self._resolve(s, owner, ref, text_ref)
                row = EvalRow(
                    revision_id=revision.id, metric=metric, value=float(value), dataset=dataset, created_at=now()
                )
                s.add(row)
                s.flush()
                out.append(EvalRecord(row.id, revision.id, revision.ref, metric, row.value, dataset, row.created_at))
        return out

    def list_evals(
        self,
        owner: str,
        ref: str,
        *,
        metric: str | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> Page[EvalRecord]:
        """Evals of the revision `ref` names, newest first, optionally only one metric."""
        parsed = parse_ref(ref)
        check_owner(owner)
        limit = cursors.check_limit(limit)
        before = cursors.decode("evals", cursor, int)
        with self._read() as s:
            revision = self._resolve(s, owner, parsed, ref)
            q = select(EvalRow).where(EvalRow.revision_id == revision.id)
            if metric is not None:
                q = q.where(EvalRow.metric == metric)
            if before is not None:
                q = q.where(EvalRow.id < before)
            rows = list(s.scalars(q.order_by(EvalRow.id.desc()).limit(limit + 1)))
        records = [
            EvalRecord(r.id, revision.id, revision.ref, r.metric, r.value, r.dataset, r.created_at)
            for r in rows
        ]
        return page_of(records, limit, "evals", lambda e: e.id)
