"""The catalog's exception hierarchy. Every message names the field or reference at fault.

The REST layer maps these onto HTTP statuses (rest.py) and the HTTP client maps them back
(client.py), so callers see the same exception type locally and remotely.
"""

from __future__ import annotations


class CatalogError(Exception):
    """Base class. `field` names the offending argument where there is one; `code`, a stable
    machine-readable reason where the check gives one (the HTTP layer reads both, never the text)."""

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_error(cls, error: BaseException) -> CatalogError:
        """`error` (an engine or service refusal) as this type: its text, field and code kept."""
        return cls(str(error), field=getattr(error, "field", None), code=getattr(error, "code", None))


class NotFound(CatalogError, LookupError):
    """No such policy/revision/alias for this owner (another owner's rows look absent, too)."""


class AlreadyExists(CatalogError):
    """A name that must be unique is taken."""


class InvalidArgument(CatalogError, ValueError):
    """An argument is malformed: a bad name, cursor, limit, metric value or PEFT directory."""


class InvalidReference(InvalidArgument):
    """A revision reference (`NAME`, `NAME@ALIAS`, `NAME@N`, `NAME@<sha prefix>`) is malformed or ambiguous."""


class IntegrityError(CatalogError):
    """Stored bytes do not match their recorded sha256: a corrupt or missing blob."""
