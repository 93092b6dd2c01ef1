"""HTTP plumbing: the FastAPI app, body limits, JSON safety, the error → status mapping, OpenAPI, metrics and uvicorn."""
