"""A real S3-compatible server on 127.0.0.1 for the object-storage tests: moto in server mode, in its own process,
reached over HTTP by boto3 and LitData exactly as a MinIO or Ceph endpoint would be. Nothing is mocked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import boto3

_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # serve until the test closes stdin
server.stop()
"""


@dataclass
class S3Server:
    endpoint: str
    key: str = "testing"  # moto accepts any credentials unless the server enforces IAM
    secret: str = "testing"

    def env(self, **changes: str) -> dict[str, str]:
        """The standard AWS variables for this server: all a user sets for an S3-compatible store."""
        values = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        return {**values, **changes}

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
        )


@contextmanager
def s3_server(enforce_iam: bool = False) -> Iterator[S3Server]:
    """Start moto's server; with `enforce_iam`, only an IAM user's key (made here) is accepted."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if enforce_iam:  # the first 3 requests may be anonymous: create the user, its key and its policy
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        server = S3Server(f"http://127.0.0.1:{port}")
        if enforce_iam:
            server = _with_iam_user(server)
        yield server
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _with_iam_user(server: S3Server) -> S3Server:
    iam = boto3.client(
        "iam", endpoint_url=server.endpoint, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
    )
    iam.create_user(UserName="trainer")
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(policy))
    return S3Server(server.endpoint, key["AccessKeyId"], key["SecretAccessKey"])


def free_port() -> int:
    """A port nothing listens on (for an endpoint that refuses connections)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def silent_endpoint() -> Iterator[str]:
    """An endpoint that accepts connections and never answers: the case that hangs clients without timeouts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
