"""The served schema's hour pattern for the billing routes (api/http/spec_bounds.HOUR) admits exactly
the real dates: a schema stricter than the server would make a generated client refuse valid
times (the 29th-31st), a looser one would send times the server refuses (2025-02-29)."""

from __future__ import annotations

import datetime
import re

from mint_server.api.http.spec_bounds import HOUR


def test_the_hour_pattern_admits_exactly_the_real_dates() -> None:
    pattern = re.compile(HOUR["pattern"])
    years = [*range(1, 30), *range(1896, 1905), *range(1996, 2104), 2400, 2500, 9999]
    wrong = []
    for year in years:
        for month in range(1, 13):
            for day in range(1, 32):
                try:
                    real = bool(datetime.date(year, month, day))
                except ValueError:
                    real = False
                text = f"{year:04d}-{month:02d}-{day:02d}T05:00:00Z"
                if bool(pattern.match(text)) != real:
                    wrong.append(text)
    assert wrong == []
    assert pattern.match("2026-12-31T23:00:00+01:00") and not pattern.match("2026-12-31T23:30:00Z")
