"""The policy catalog over HTTP: policies, revisions, aliases and evals (MLflow-registry style)."""
