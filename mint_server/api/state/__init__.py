"""The service's state stores: training runs and checkpoints, sessions, futures, usage, per-run metrics."""
