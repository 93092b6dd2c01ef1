"""The HTTP service (see app.py). Kept import-free: the CLI's remote catalog client reads the
prefix below without loading FastAPI."""

CATALOG_PREFIX = "/api/v1/mint/catalog"  # where the catalog's REST routes are mounted
KEYS_PREFIX = "/api/v1/mint/keys"  # scoped API keys (admin scope)
