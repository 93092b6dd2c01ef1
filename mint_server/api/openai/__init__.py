"""The OpenAI-compatible face: /oai/api/v1 and /v1 (models, completions, chat completions, streaming)."""
