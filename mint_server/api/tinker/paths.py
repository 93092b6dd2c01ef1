"""Checkpoint paths as clients write them: `tinker://<run>/<kind>/<name>` (`mint://` is a synonym),
and policy references `tinker://NAME@ALIAS|N|<sha prefix>` where a path is read for sampling.

Parsing only checks shape; whether the checkpoint exists and who may read it is the registry's
(or the catalog's) business. A parsed path never becomes a filesystem path by itself: the registry
maps it to a directory it created.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from mint_server.catalog.errors import InvalidReference
from mint_server.catalog.refs import parse_ref

# external_weights: save_weights_external's exports, kept only to be downloaded (never sampled or loaded).
Kind = Literal["weights", "sampler_weights", "external_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights", "external_weights")
CHECKPOINT_TYPE: dict[Kind, Literal["training", "sampler", "external"]] = {
    "weights": "training", "sampler_weights": "sampler", "external_weights": "external",
}
SCHEMES = ("tinker://", "mint://")

# Run ids are ours ("<session hex>:train:<n>"); names are the client's, so they are kept to a safe
# alphabet that can never spell a path component like ".." or contain a separator.
RUN_ID = re.compile(r"^[0-9a-f]{32}:train:[0-9]{1,9}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class PathError(ValueError):
    """A malformed checkpoint path or name; the message says what is wrong."""


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: Kind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"


def check_name(name: str, what: str = "checkpoint name") -> str:
    if not NAME.match(name) or ".." in name:
        raise PathError(
            f"invalid {what} {name!r}: use 1-128 letters, digits, '_', '-' or '.', starting with a letter or digit"
        )
    return name


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise PathError(f"invalid training run id {run_id!r}")
    return run_id


def parse_kind(kind: str) -> Kind:
    if kind not in KINDS:
        raise PathError(f"unknown checkpoint kind {kind!r}; expected one of {', '.join(KINDS)}")
    return kind  # type: ignore[return-value]


def parse_checkpoint_path(path: str) -> CheckpointRef:
    scheme = next((s for s in SCHEMES if path.startswith(s)), None)
    if scheme is None:
        raise PathError(f"invalid checkpoint path {path!r}: expected tinker://<run>/weights|sampler_weights/<name>")
    parts = path[len(scheme) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise PathError(f"invalid checkpoint path {path!r}: expected tinker://<run>/weights|sampler_weights/<name>")
    run_id, kind, name = parts
    try:
        return CheckpointRef(check_run_id(run_id), parse_kind(kind), check_name(name))
    except PathError as e:
        raise PathError(f"invalid checkpoint path {path!r}: {e}") from None


def is_checkpoint_path(text: str) -> bool:
    return text.startswith(SCHEMES)


def parse_policy_ref(path: str) -> str | None:
    """The catalog reference in `tinker://NAME@SELECTOR` (or `mint://…`), or None for any other path.

    Run paths always hold a '/' (`tinker://<run>/<kind>/<name>`; run ids and checkpoint names
    cannot contain '@') and policy references never do, so a path is a policy reference exactly
    when it has an '@' and no '/' after the scheme. A malformed reference is a PathError naming it.
    """
    scheme = next((s for s in SCHEMES if path.startswith(s)), None)
    if scheme is None:
        return None
    ref = path[len(scheme) :]
    if "/" in ref or "@" not in ref:
        return None
    try:
        parse_ref(ref, field="policy reference")
    except InvalidReference as e:
        raise PathError(f"invalid path {path!r}: {e}") from None
    return ref
