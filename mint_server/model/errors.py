"""The model layer's errors, in a leaf module: the config readers of each family's spec (mla_spec,
v4_spec, vision_spec, hybrid_spec, prequant_spec) raise them where they find the problem, and
config.py, which imports those readers, re-exports them."""

from __future__ import annotations


class ModelError(ValueError):
    """A model directory or config that we cannot load; the message names the problem."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture (or a part of it) is not one we implement."""
