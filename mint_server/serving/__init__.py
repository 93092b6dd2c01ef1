"""Serving helpers that speak neither HTTP nor tensors: chat templates, tool calls, streamed text."""
