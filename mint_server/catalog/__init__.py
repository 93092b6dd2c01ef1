"""The durable policy catalog: LoRA policies, immutable adapter revisions, aliases, evals.

    from mint_server.catalog import Catalog
    catalog = Catalog.open()                       # SQLite in the data dir, or Catalog.open(postgres_url)
    rev = catalog.publish_revision(owner, "my-policy", peft_dir, base_model=..., lora_config=...)
    catalog.set_alias(owner, "my-policy", "prod", rev.number, actor=owner)
    catalog.materialize(catalog.resolve(owner, "my-policy@prod"), "/tmp/adapter")

Names are loaded on first use (PEP 562) so that importing the light modules (errors, records)
does not pull in SQLAlchemy: the `mint` CLI imports this package for every command.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "mint_server.catalog.blobs": ("BlobInfo", "BlobStore"),
    "mint_server.catalog.local_blobs": ("LocalBlobStore",),
    "mint_server.catalog.catalog": ("Catalog",),
    "mint_server.catalog.errors": (
        "AlreadyExists",
        "CatalogError",
        "IntegrityError",
        "InvalidArgument",
        "InvalidReference",
        "NotFound",
    ),
    "mint_server.catalog.payload": ("ManifestEntry",),
    "mint_server.catalog.keys": ("KeyStore",),
    "mint_server.catalog.records": (
        "Alias",
        "AliasEvent",
        "ApiKey",
        "EvalRecord",
        "GcReport",
        "ImportResult",
        "Page",
        "Policy",
        "Revision",
        "SeedResult",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)

if TYPE_CHECKING:
    from mint_server.catalog.blobs import BlobInfo, BlobStore  # noqa: F401
    from mint_server.catalog.catalog import Catalog  # noqa: F401
    from mint_server.catalog.errors import (  # noqa: F401
        AlreadyExists,
        CatalogError,
        IntegrityError,
        InvalidArgument,
        InvalidReference,
        NotFound,
    )
    from mint_server.catalog.keys import KeyStore  # noqa: F401
    from mint_server.catalog.local_blobs import LocalBlobStore  # noqa: F401
    from mint_server.catalog.payload import ManifestEntry  # noqa: F401
    from mint_server.catalog.records import (  # noqa: F401
        Alias,
        AliasEvent,
        ApiKey,
        EvalRecord,
        GcReport,
        ImportResult,
        Page,
        Policy,
        Revision,
        SeedResult,
    )


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
