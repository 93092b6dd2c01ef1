"""API keys, their scopes, owner ids and the short-lived tokens we sign.

Two kinds of key:

* Configured keys (`--api-key`, `MINT_API_KEYS`, the data dir's `api_key` file) hold every scope; a
  caller presenting one acts as the sha256 of the key (its *owner id*).
* Scoped keys (`mint key create`, `POST /api/v1/mint/keys`) act as an owner they were made for and hold
  only their scopes. They read `tml-mk_<key id>_<secret>`: the key id (public) finds the stored
  record, whose sha256 of the whole key is compared in constant time. The store (catalog/keys.py) is
  read on every request, so a revoked key stops working at once, JWTs it was traded for included.

Scopes nest: `serve` (the OpenAI face, sampling, sessions and futures) ⊂ `train` (everything a tenant
does with its own runs, checkpoints and catalog) ⊂ `admin` (managing keys). The key itself is never
stored or logged. Two kinds of token are signed with a per-data-dir secret:

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
from typing import TYPE_CHECKING, Any

from mint_server.catalog.errors import InvalidArgument  # light: no SQLAlchemy
from mint_server.fsutil import atomic_write_bytes, fsync_dir

if TYPE_CHECKING:
    from mint_server.catalog.keys import KeyStore
    from mint_server.catalog.records import ApiKey

KEY_PREFIXES = ("tml-", "sk-")
JWT_LIFETIME_S = 3600
_ANONYMOUS = "anonymous"

SERVE, TRAIN, ADMIN = "serve", "train", "admin"
SCOPES = (SERVE, TRAIN, ADMIN)  # each holds the ones before it
ALL_SCOPES = frozenset(SCOPES)
SCOPED_PREFIX = "tml-mk_"
_KEY_ID_HEX = 16
_SECRET_HEX = 48


class AuthError(Exception):
    """Missing, unknown or revoked credential (HTTP 401)."""

    code = "invalid_api_key"  # the machine-readable reason the HTTP layer sends with it


class ScopeError(Exception):
    """A valid key without the scope an operation needs (HTTP 403)."""

    code = "insufficient_scope"


@dataclass(frozen=True)
class Principal:
    owner: str  # whom records are keyed by: the sha256 hex of a configured key, or a scoped key's owner
    wants_jwt: bool = False  # presented an `sk-` key: advertise JWT exchange to it
    scopes: frozenset[str] = ALL_SCOPES
    key_id: str | None = None  # the scoped key presented, if any

    @property
    def urn(self) -> str:
        """Who is calling, as `whoami` names it: the key (a scoped key by its id; a configured key by
        the start of its digest, which is its owner id). The tenant is `owner`."""
        return f"mint:key:{self.key_id or self.owner[:16]}"

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            held = ", ".join(s for s in SCOPES if s in self.scopes) or "none"
            raise ScopeError(f"this API key lacks the {scope!r} scope this operation needs (it holds: {held})")


def granted(scopes: list[str] | tuple[str, ...]) -> frozenset[str]:
    """The scopes a key holds: the ones it names and every scope they include."""
    top = max(SCOPES.index(s) for s in scopes)
    return frozenset(SCOPES[: top + 1])


def parse_scopes(value: Any) -> list[str]:
    """A key's scopes as given at creation: a non-empty list of known scope names (or one name)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise InvalidArgument(f"scopes must be a non-empty list of {', '.join(SCOPES)}", field="scopes")
    unknown = [s for s in value if s not in SCOPES]
    if unknown:
        raise InvalidArgument(f"scopes: unknown scope {unknown[0]!r} (known: {', '.join(SCOPES)})", field="scopes")
    return [s for s in SCOPES if s in value]


def issue_key(store: KeyStore, owner: str, name: str, scopes: Any) -> tuple[ApiKey, str]:
    """Make a scoped key for `owner` and record its digest; the key is returned once, here."""
    key_id = secrets.token_hex(_KEY_ID_HEX // 2)
    key = f"{SCOPED_PREFIX}{key_id}_{secrets.token_hex(_SECRET_HEX // 2)}"
    return store.create(owner, key_id, owner_id(key), name, parse_scopes(scopes)), key


def _scoped_key_id(credential: str) -> str | None:
    """The key id of a credential shaped like a scoped key; None for any other credential."""
    if not credential.startswith(SCOPED_PREFIX):
        return None
    rest = credential[len(SCOPED_PREFIX):]
    if len(rest) != _KEY_ID_HEX + 1 + _SECRET_HEX or rest[_KEY_ID_HEX] != "_":
        return None
    return rest[:_KEY_ID_HEX]


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
    def __init__(self, api_keys: tuple[str, ...], signer: Signer, no_auth: bool, keys: KeyStore | None = None) -> None:
        for key in api_keys:
            check_key_form(key)
        # Only digests are held, so a heap dump or a log of this object shows no key.
        self._owners = tuple(owner_id(k) for k in api_keys)
        self._signer = signer
        self._no_auth = no_auth
        self.keys = keys

    def authenticate(self, credential: str | None) -> Principal:
        if credential and credential.startswith("eyJ"):
            return self._from_token(credential, "access")
        wants_jwt = bool(credential and credential.startswith("sk-"))
        if credential and (key_id := _scoped_key_id(credential)) is not None:
            scoped = self._scoped(key_id, owner_id(credential), wants_jwt)
            if scoped is not None:
                return scoped
        if self._no_auth:
            return Principal(owner=owner_id(credential) if credential else _ANONYMOUS, wants_jwt=wants_jwt)
        if not credential:
            raise AuthError("missing X-API-Key header")
        owner = owner_id(credential)
        if not self._configured(owner):
            raise AuthError("unknown API key")
        return Principal(owner=owner, wants_jwt=wants_jwt)

    def _configured(self, digest: str) -> bool:
        found = False
        for known in self._owners:  # every digest compared, in constant time each
            found |= hmac.compare_digest(digest, known)
        return found

    def _scoped(self, key_id: str, digest: str, wants_jwt: bool) -> Principal | None:
        """The principal of a live scoped key; None if no key has this id and digest."""
        found = self.keys.get(key_id) if self.keys is not None else None
        if found is None or not hmac.compare_digest(digest, found[1]):
            return None
        record = found[0]
        if record.revoked_at is not None:
            raise AuthError("this API key has been revoked")
        return Principal(owner=record.owner, wants_jwt=wants_jwt, scopes=granted(record.scopes), key_id=key_id)

    def _from_token(self, token: str, typ: str) -> Principal:
        """Whom a token we signed acts for, checked against the key it was issued to as of now."""
        claims = self._signer.verify(token)
        owner = claims.get("own", claims.get("sub")) if claims is not None else None
        if claims is None or claims.get("typ") != typ or not isinstance(owner, str):
            raise AuthError("invalid or expired token")
        key_id = claims.get("kid")
        if key_id is None:
            if not (self._no_auth or self._configured(owner)):
                raise AuthError("invalid or expired token")  # its key is no longer configured
            return Principal(owner=owner)
        found = self.keys.get(key_id) if self.keys is not None and isinstance(key_id, str) else None
        if found is None or found[0].owner != owner:
            raise AuthError("invalid or expired token")
        if found[0].revoked_at is not None:
            raise AuthError("the API key this token was issued to has been revoked")
        return Principal(owner=owner, scopes=granted(found[0].scopes), key_id=key_id)

    def _claims(self, principal: Principal) -> dict[str, Any]:
        return {"sub": principal.owner} | ({"kid": principal.key_id} if principal.key_id else {})

    def issue_jwt(self, principal: Principal) -> str:
        """An access token with the identity claims tinker 0.38's `whoami` reads: `sub` (the key, as
        a URN), `org_id` (the tenant: the owner id) and `email` (none: keys are not people). The
        owner the token acts as is `own` (tokens from before it carried the owner in `sub`)."""
        now = int(time.time())
        identity = {"sub": principal.urn, "own": principal.owner, "org_id": principal.owner, "email": ""}
        return self._signer.issue(
            self._claims(principal) | identity | {"typ": "access", "iss": "mint", "iat": now, "exp": now + JWT_LIFETIME_S}
        )

    def issue_session(self, principal: Principal, lifetime_s: int) -> str:
        """The dashboard's login cookie: a token standing for the key that logged in, checked against
        that key on every request (a revoked key logs its sessions out)."""
        exp = int(time.time()) + lifetime_s
        return self._signer.issue(self._claims(principal) | {"typ": "dashboard", "exp": exp})

    def from_session(self, token: str) -> Principal:
        return self._from_token(token, "dashboard")

    def sign(self, message: str) -> str:
        return self._signer.sign(message.encode())

    def issue_download(self, principal: Principal, subject: dict[str, str], lifetime_s: int = 900) -> tuple[str, int]:
        exp = int(time.time()) + lifetime_s
        return self._signer.issue(self._claims(principal) | subject | {"typ": "download", "exp": exp}), exp

    def verify_download(self, token: str) -> dict[str, Any] | None:
        """The claims of a live download link (its key not revoked since); None otherwise."""
        try:
            self._from_token(token, "download")
        except AuthError:
            return None
        return self._signer.verify(token)


def random_id() -> str:
    return os.urandom(16).hex()


def data_dir_owner(data_dir: Path) -> str:
    """Whom the local data dir's records belong to: the owner of the key `mint serve` keeps in its
    `api_key` file, which is created here if nothing made it yet. So whichever runs first (`mint
    serve`, `mint import`, `mint catalog seed`, `mint key create`), policies land under the owner the
    server's own key acts as."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return owner_id(load_or_create_key_file(data_dir / "api_key"))


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
