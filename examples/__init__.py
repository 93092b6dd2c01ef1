"""Post-training examples: tinker-cookbook recipes driven against a MinT server (see README.md)."""
