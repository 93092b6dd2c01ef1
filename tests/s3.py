"""A real S3 API server on loopback for the S3 blob store tests: moto's standalone server, in a process
of its own (so its request handling does not share the test's GIL), on a free port."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

_SERVER = """
import sys
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the test closes our stdin
"""
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def s3_server() -> Iterator[str]:
    """The endpoint URL of a fresh moto S3 server."""
    pytest.importorskip("moto", reason="the S3 store tests need moto's server: pip install 'moto[server]'")
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        port = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert port.isdigit(), "moto's server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment a process needs to reach the server (what an S3 deployment sets too)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}


def new_bucket(endpoint: str) -> str:
    import boto3  # moto's own dependency

    name = f"mint-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in CREDENTIALS.items()
                                                 if k != "AWS_DEFAULT_REGION"},
                 region_name=CREDENTIALS["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)
    return name


@contextmanager
def s3_environ(endpoint: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in s3_env(endpoint)}
    os.environ.update(s3_env(endpoint))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
