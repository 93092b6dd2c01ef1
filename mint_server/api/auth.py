"""API keys, owner ids and the short-lived tokens we sign.

A caller is identified by the sha256 of its API key (its *owner id*); the key itself is never stored
or logged. Two kinds of token are signed with a per-data-dir secret:

* JWTs for `sk-` callers. tinker 0.22 (pinned by mindlab-toolkit) refuses `sk-` keys unless the
  server turns on JWT exchange, so those callers trade their key for a JWT at /auth/token.
* Download tokens for checkpoint archives, whose URLs are fetched without the API key.

The secret lives in the data dir so that tokens stay valid across a restart.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mint_server.fsutil import atomic_write_bytes, fsync_dir

KEY_PREFIXES = ("tml-", "sk-")
JWT_LIFETIME_S = 3600
_ANONYMOUS = "anonymous"


class AuthError(Exception):
    """Missing or unknown credential (HTTP 401)."""


@dataclass(frozen=True)
class Principal:
    owner: str  # sha256 hex of the API key: what records are keyed by
    wants_jwt: bool = False  # presented an `sk-` key: advertise JWT exchange to it


def owner_id(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def check_key_form(key: str) -> None:
    """Configured keys must look like the keys the SDKs send, or no client could ever use them."""
    if not key.startswith(KEY_PREFIXES) or len(key) < 8 or any(c.isspace() for c in key):
        raise ValueError("API keys must start with 'tml-' or 'sk-', be at least 8 characters and hold no spaces")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """HMAC-SHA256 over a secret kept in the data dir."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> Signer:
        path = data_dir / "server_secret"
        if not path.is_file():
            atomic_write_bytes(path, secrets.token_bytes(32), mode=0o600)
        return cls(path.read_bytes())

    def sign(self, message: bytes) -> str:
        return _b64(hmac.new(self._secret, message, hashlib.sha256).digest())

    def issue(self, claims: dict[str, Any]) -> str:
        """A JWT (HS256). The SDK only reads its `exp`; we check the signature ourselves."""
        head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{head}.{body}.{self.sign(f'{head}.{body}'.encode())}"

    def verify(self, token: str) -> dict[str, Any] | None:
        """The claims of a token we issued that has not expired; None otherwise."""
        parts = token.split(".")
        if len(parts) != 3:
            return None
        head, body, sig = parts
        if not hmac.compare_digest(sig, self.sign(f"{head}.{body}".encode())):
            return None
        try:
            claims = json.loads(_unb64(body))
        except ValueError:
            return None
        if not isinstance(claims, dict) or not isinstance(claims.get("exp"), int | float):
            return None
        return claims if claims["exp"] > time.time() else None


class Authenticator:
    def __init__(self, api_keys: tuple[str, ...], signer: Signer, no_auth: bool) -> None:
        for key in api_keys:
            check_key_form(key)
        # Only digests are held, so a heap dump or a log of this object shows no key.
        self._owners = frozenset(owner_id(k) for k in api_keys)
        self._signer = signer
        self._no_auth = no_auth

    def authenticate(self, credential: str | None) -> Principal:
        if credential and credential.startswith("eyJ"):
            claims = self._signer.verify(credential)
            if claims is None or claims.get("typ") != "access" or not isinstance(claims.get("sub"), str):
                raise AuthError("invalid or expired token")
            return Principal(owner=claims["sub"])
        wants_jwt = bool(credential and credential.startswith("sk-"))
        if self._no_auth:
            return Principal(owner=owner_id(credential) if credential else _ANONYMOUS, wants_jwt=wants_jwt)
        if not credential:
            raise AuthError("missing X-API-Key header")
        owner = owner_id(credential)
        if owner not in self._owners:
            raise AuthError("unknown API key")
        return Principal(owner=owner, wants_jwt=wants_jwt)

    def issue_jwt(self, principal: Principal) -> str:
        now = int(time.time())
        return self._signer.issue(
            {"sub": principal.owner, "typ": "access", "iss": "mint", "iat": now, "exp": now + JWT_LIFETIME_S}
        )

    def issue_download(self, subject: dict[str, str], lifetime_s: int = 900) -> tuple[str, int]:
        exp = int(time.time()) + lifetime_s
        return self._signer.issue({**subject, "typ": "download", "exp": exp}), exp

    def verify_download(self, token: str) -> dict[str, Any] | None:
        claims = self._signer.verify(token)
        return claims if claims and claims.get("typ") == "download" else None


def random_id() -> str:
    return os.urandom(16).hex()


def load_or_create_key_file(path: Path) -> str:
    """The API key kept in `path`, created there (mode 0600) on first use.

    The key is written to a temp file and hard-linked into place, which fails if `path` exists:
    two servers starting at once on one data dir agree on the first key instead of each keeping
    its own. The file never exists half-written.
    """
    if not path.exists():
        key = "tml-" + secrets.token_hex(24)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process created it first; use theirs
            else:
                fsync_dir(path.parent)
        finally:
            os.unlink(tmp)
    key = path.read_text().strip()
    try:
        check_key_form(key)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return key
