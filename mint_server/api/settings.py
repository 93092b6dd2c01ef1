"""Service settings: everything `mint serve` decides before the app starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    api_keys: tuple[str, ...] = ()
    # The policy catalog's database; None: SQLite in the data dir.
    db_url: str | None = None
    # Its blob store (catalog/blobs.py open_blob_store: a path or s3://bucket/prefix); None: <data dir>/blobs.
    store_url: str | None = None
    no_auth: bool = False
    max_body_bytes: int = 256 * 1024 * 1024
    # A request body must keep arriving: a pause longer than this answers 408.
    body_timeout_s: float = 60.0
    # The SDK heartbeats every 10 s and warns after 2 min without one; past this we reclaim the session.
    session_ttl_s: float = 180.0
    # retrieve_future holds a pending request this long before answering try_again (SDK timeout is 45 s).
    long_poll_s: float = 20.0
    # Finished results stay retrievable this long: the SDK may re-poll after a dropped connection.
    result_ttl_s: float = 900.0
    # In-flight sample requests before asample answers 429 (the SDK backs off and resubmits).
    max_inflight_samples: int = 512
    # Unfinished requests one API key may have at once (every kind); beyond it, 429 + Retry-After.
    max_pending_per_key: int = 256
    # How often expired sessions, results and checkpoints are swept.
    upkeep_interval_s: float = 5.0
    # How long shutdown waits for in-flight work before giving up on it.
    drain_timeout_s: float = 120.0
    # Lifetime of the signed URLs external_weights_urls hands out (and of archive download links).
    download_url_ttl_s: int = 900
