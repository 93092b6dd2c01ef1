"""Names and revision references.

Grammar of a reference (what `Catalog.resolve` accepts):

    NAME                 latest revision of the policy
    NAME@N               revision number N (decimal, N >= 1)
    NAME@ALIAS           the revision an alias points to
    NAME@<hex>           revision whose sha256 starts with <hex> (6..64 hex digits)
    NAME@sha256:<hex>    the same, explicitly (needed for an all-digit prefix)

The forms are unambiguous because alias names must start with a letter and may not look like a
sha prefix (all hex, six or more characters): all digits means a number, otherwise six or more hex
digits means a sha prefix, otherwise it is an alias.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from mint_server.catalog.errors import InvalidArgument, InvalidReference

POLICY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ALIAS_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
_HEX_RE = re.compile(r"[0-9a-fA-F]{6,64}")
_DIGITS_RE = re.compile(r"[0-9]{1,18}")
MIN_SHA_PREFIX = 6


@dataclass(frozen=True)
class Ref:
    policy: str
    kind: Literal["latest", "number", "alias", "sha"]
    number: int | None = None
    alias: str | None = None
    sha_prefix: str | None = None  # lowercase


def check_policy_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not POLICY_NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"{field} {name!r} is not a valid policy name (1-128 of letters, digits, '.', '_', '-'; "
            "starting with a letter or digit)",
            field=field,
        )
    return name


def check_alias_name(alias: str, field: str = "alias") -> str:
    if not isinstance(alias, str) or not ALIAS_NAME_RE.fullmatch(alias):
        raise InvalidArgument(
            f"{field} {alias!r} is not a valid alias name (1-64 of letters, digits, '.', '_', '-'; "
            "starting with a letter)",
            field=field,
        )
    if _HEX_RE.fullmatch(alias):
        raise InvalidArgument(
            f"{field} {alias!r} looks like a sha256 prefix; alias names must not be all hex", field=field
        )
    return alias


def check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not owner or len(owner) > 256:
        raise InvalidArgument("owner must be a non-empty string of at most 256 characters", field="owner")
    return owner


def parse_ref(text: str, field: str = "ref") -> Ref:
    """Parse a reference; raises InvalidReference naming the reference when it is malformed."""
    if not isinstance(text, str) or not text:
        raise InvalidReference(
            f"{field} is empty; expected NAME, NAME@ALIAS, NAME@N or NAME@<sha>", field=field
        )
    name, sep, selector = text.partition("@")
    if not POLICY_NAME_RE.fullmatch(name):
        raise InvalidReference(f"{field} {text!r}: {name!r} is not a valid policy name", field=field)
    if not sep:
        return Ref(name, "latest")
    if not selector:
        raise InvalidReference(f"{field} {text!r}: nothing after '@'", field=field)
    if _DIGITS_RE.fullmatch(selector):
        number = int(selector)
        if number < 1:
            raise InvalidReference(f"{field} {text!r}: revision numbers start at 1", field=field)
        return Ref(name, "number", number=number)
    explicit_sha = selector.startswith("sha256:")
    hex_part = selector.removeprefix("sha256:")
    if _HEX_RE.fullmatch(hex_part):
        return Ref(name, "sha", sha_prefix=hex_part.lower())
    if explicit_sha:
        raise InvalidReference(
            f"{field} {text!r}: a sha256 prefix needs {MIN_SHA_PREFIX}-64 hex digits", field=field
        )
    if ALIAS_NAME_RE.fullmatch(selector):
        return Ref(name, "alias", alias=selector)
    raise InvalidReference(
        f"{field} {text!r}: {selector!r} is neither a revision number, a sha256 prefix "
        f"({MIN_SHA_PREFIX}+ hex digits) nor an alias name",
        field=field,
    )
