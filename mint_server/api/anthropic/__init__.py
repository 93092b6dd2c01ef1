"""The Anthropic Messages-compatible face (docs/anthropic.md)."""
