"""MinT server: one resident base model, many LoRA policies, behind the Tinker API."""

__version__ = "0.1.0"
