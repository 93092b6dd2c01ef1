"""API keys, scopes and signed tokens, and the routes that manage keys."""
