"""Which blob store a URL names (the one place that knows every backend)."""

from __future__ import annotations

import os
from pathlib import Path

from mint_server.catalog.blobs import BlobStore
from mint_server.catalog.errors import InvalidArgument
from mint_server.catalog.local_blobs import LocalBlobStore


def open_blob_store(url: str | os.PathLike[str] | None, default_root: Path) -> BlobStore:
    """The store at `url`: None → `default_root`; a path or file://PATH → local; s3://bucket/prefix → S3
    (endpoint, region and credentials from the usual AWS_* environment variables)."""
    if url is None or str(url) == "":
        return LocalBlobStore(default_root)
    text = str(url)
    if text.startswith("s3://"):
        try:
            from mint_server.catalog.s3 import S3BlobStore
        except ImportError as e:  # obstore is a dependency; a trimmed install may lack it
            raise InvalidArgument(f"store {text!r}: the S3 store needs obstore ({e})", field="store") from None
        return S3BlobStore.from_url(text)
    if text.startswith("file://"):
        return LocalBlobStore(text[len("file://") :])
    if "://" in text:
        raise InvalidArgument(f"store {text!r}: unsupported scheme (use a path, file://PATH or s3://BUCKET/PREFIX)",
                              field="store")
    return LocalBlobStore(text)
