"""Where shards live: a local directory or `s3://bucket/prefix`, with the few file operations the converter and
the training run need, each failure said in one line naming the URL and the cause.

Object storage goes through boto3, configured only by the standard AWS variables and files
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `AWS_ENDPOINT_URL` for MinIO, Ceph and other
S3-compatible stores, ...). Every request here is bounded (`timeout_s` to connect and to read, `ATTEMPTS`
tries), so a store that does not answer ends the run within seconds instead of botocore's minutes of retries.
Every message shows URLs without their credentials (`redact`): an endpoint written `http://user:password@host`
would otherwise reach the terminal, train.log and failed.json.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)

from imgtrain.common.atomic import atomic_write
from imgtrain.common.credentials import without_userinfo
from imgtrain.common.errors import ConfigError, RunError

S3_SCHEME = "s3://"
ATTEMPTS = 2  # tries per request here: one retry absorbs a blip; a dead endpoint fails in 2 x timeout_s
DEFAULT_TIMEOUT_S = 10.0

_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / ~/.aws/credentials), and AWS_ENDPOINT_URL "
    "for an S3-compatible store"
)
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden", "403", "InvalidToken"}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}
# s3://bucket/prefix: a bucket name as S3 allows it (legacy names included: capitals, '_'); a prefix of plain
# folder names (no '.' or '..'). Both are also a path under dataset.cache_dir, which they must not leave.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{2,254}")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/")  # what looks like a URL (S3://, s3:/, gs://), not a path
_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")  # botocore reads both


def redact(text: str) -> str:
    """`text` with every URL's `user:password@` removed, and the AWS key, secret and token, should a message from
    a store or a library quote them, replaced: what is printed or logged never holds credentials."""
    text = without_userinfo(text)
    for name in _ENDPOINT_VARIABLES:  # also written without a scheme (user:password@host), which botocore quotes
        host = os.environ.get(name, "").split("://", 1)[-1].split("/", 1)[0]
        if "@" in host:
            text = text.replace(host[: host.rfind("@") + 1], "")
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name, "")
        if len(value) >= 4:  # a one-letter value would blank out ordinary words
            text = text.replace(value, f"<{name}>")
    return text


class StorageError(RunError):
    """A store that cannot be read or written: one line naming the URL and the cause."""


@dataclass(frozen=True)
class Location:
    """A directory or an S3 prefix; `join` names a file under it."""

    url: str  # as the user wrote it, without a trailing slash

    @classmethod
    def parse(cls, text: str, key: str = "dataset.root") -> Location:
        text = str(text).strip()
        if not text.startswith(S3_SCHEME) and not (_SCHEME.match(text) or text.lower().startswith("s3:")):
            return cls(os.path.abspath(os.path.expanduser(text)))
        # Anything URL-like but not exactly s3:// (S3://, s3:/) would otherwise become a local folder of that name.
        shown = redact(text)
        expected = "a directory, or object storage written s3://bucket/prefix (lower-case s3, two slashes)"
        if not text.startswith(S3_SCHEME):
            raise ConfigError(f"{key}={shown} is neither a directory nor an S3 URL: expected {expected}")
        bucket, _, prefix = text[len(S3_SCHEME) :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(
                f"{key}={shown}: {bucket!r} is not an S3 bucket name (3 to 255 letters, digits, '.', '-' and '_'): "
                f"expected {expected}"
            )
        if any(part in (".", "..") for part in prefix.split("/")):
            raise ConfigError(f"{key}={shown}: the prefix may not contain '.' or '..' folders: expected {expected}")
        return cls(text.rstrip("/"))

    @property
    def is_s3(self) -> bool:
        return self.url.startswith(S3_SCHEME)

    @property
    def bucket(self) -> str:
        return self.url[len(S3_SCHEME) :].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        """The key prefix under the bucket, '' for the bucket's root, else ending in '/'."""
        rest = self.url[len(S3_SCHEME) :].split("/", 1)
        return rest[1].strip("/") + "/" if len(rest) > 1 and rest[1].strip("/") else ""

    def join(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def child(self, name: str) -> Location:
        return Location(self.join(name))

    def __str__(self) -> str:
        return self.url


# ----------------------------------------------------------------------------- object storage
def s3_client(timeout_s: float = DEFAULT_TIMEOUT_S):
    """A boto3 S3 client from the standard AWS configuration, with bounded timeouts and retries."""
    config = BotoConfig(
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        retries={"total_max_attempts": ATTEMPTS, "mode": "standard"},
    )
    try:
        return boto3.session.Session().client("s3", config=config)
    except (ValueError, BotoCoreError) as error:  # botocore's own line: "Invalid endpoint: ...", a missing profile
        raise ConfigError(
            redact(
                f"object storage cannot be configured from the AWS settings ({str(error).rstrip('.')}): check "
                "AWS_ENDPOINT_URL (http://host:port or https://host), AWS_PROFILE and AWS_DEFAULT_REGION"
            )
        ) from None


def endpoint(client) -> str:
    """The client's endpoint as messages show it: without credentials."""
    return redact(client.meta.endpoint_url)


def storage_error(url: str, error: Exception, client=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> StorageError:
    """One line for a failed request to `url`: missing bucket or object, credentials, or an endpoint that does not
    answer; without credentials (botocore quotes the endpoint URL in its own messages)."""
    return StorageError(redact(_storage_line(url, error, client, timeout_s)))


def _storage_line(url: str, error: Exception, client, timeout_s: float) -> str:
    where = f" at {endpoint(client)}" if client is not None else ""
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return f"{url}: no AWS credentials found: {_CREDENTIALS}"
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = str(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code == "NoSuchBucket":
            return f"{url}: the bucket {Location(url).bucket} does not exist{where}"
        if code in _DENIED or status == "403":
            return f"{url}: access denied{where} ({code or status}): check the credentials: {_CREDENTIALS}"
        if code in _MISSING_KEY or status == "404":
            return f"{url}: not found{where}"
        return f"{url}: the store{where} answered {code or status}: {error}"
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, EndpointConnectionError):
        return f"{url}: could not connect to the endpoint{where} ({reason}); check AWS_ENDPOINT_URL"
    return (
        f"{url}: the endpoint{where} did not answer within {timeout_s:g} s x {ATTEMPTS} tries ({reason}); check "
        "AWS_ENDPOINT_URL and the network"
    )


class Store:
    """Small-file operations under one Location (manifests, listings, clean-up); shard data goes through the
    engine. Local paths need no client; S3 clients are made on first use."""

    def __init__(self, location: Location, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.location, self.timeout_s = location, timeout_s
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = s3_client(self.timeout_s)
        return self._client

    @property
    def endpoint(self) -> str:
        """Where the location lives: the S3 endpoint without credentials, or "" for a local path."""
        return endpoint(self.client) if self.location.is_s3 else ""

    def _key(self, name: str) -> str:
        return self.location.prefix + name

    def _fail(self, name: str, error: Exception) -> StorageError:
        return storage_error(
            self.location.join(name) if name else self.location.url, error, self.client, self.timeout_s
        )

    def read_text(self, name: str) -> str | None:
        """The file's text, or None when it does not exist (a missing bucket is an error)."""
        if not self.location.is_s3:
            path = Path(self.location.url, name)
            return self._text(name, path.read_bytes()) if path.is_file() else None
        try:
            body = self.client.get_object(Bucket=self.location.bucket, Key=self._key(name))["Body"]
            return self._text(name, body.read())
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._fail(name, error) from None
        except BotoCoreError as error:
            raise self._fail(name, error) from None

    def _text(self, name: str, data: bytes) -> str:
        """`data` as UTF-8 text; one line naming the file otherwise (a manifest or an index someone overwrote)."""
        try:
            return data.decode()
        except UnicodeDecodeError as error:
            raise StorageError(
                f"{self.location.join(name)} is not UTF-8 text ({error.reason} at byte {error.start}): it is not a "
                "file imgtrain-shards wrote; convert the dataset again"
            ) from None

    def write_text(self, name: str, text: str) -> None:
        """Write the file whole: readers see the old version or the new one, never a part."""
        if not self.location.is_s3:
            atomic_write(Path(self.location.url, name), lambda f: f.write(text.encode()), durable=True)
            return
        try:  # a PUT is atomic on S3: the object appears complete or not at all
            self.client.put_object(Bucket=self.location.bucket, Key=self._key(name), Body=text.encode())
        except (ClientError, BotoCoreError) as error:
            raise self._fail(name, error) from None

    def sizes(self, sub: str = "") -> dict[str, int]:
        """Every file under `sub` (recursively) with its size in bytes, by path relative to `sub`."""
        if not self.location.is_s3:
            top = Path(self.location.url, sub)
            if not top.is_dir():
                return {}
            return {str(p.relative_to(top)): p.stat().st_size for p in top.rglob("*") if p.is_file()}
        prefix = self._key(f"{sub.strip('/')}/" if sub else "")
        found: dict[str, int] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket, Prefix=prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    found[item["Key"][len(prefix) :]] = int(item["Size"])
        except (ClientError, BotoCoreError) as error:
            raise self._fail(sub, error) from None
        return found

    def remove(self, sub: str) -> None:
        """Delete everything under `sub` (a split's shards from a conversion that did not finish)."""
        if not self.location.is_s3:
            shutil.rmtree(Path(self.location.url, sub), ignore_errors=True)
            return
        keys = [self._key(f"{sub}/{name}") for name in self.sizes(sub)]
        try:
            for first in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
                batch = [{"Key": key} for key in keys[first : first + 1000]]
                self.client.delete_objects(Bucket=self.location.bucket, Delete={"Objects": batch, "Quiet": True})
        except (ClientError, BotoCoreError) as error:
            raise self._fail(sub, error) from None

    def delete(self, name: str) -> None:
        """Delete one file (gone already is fine)."""
        if not self.location.is_s3:
            Path(self.location.url, name).unlink(missing_ok=True)
            return
        try:
            self.client.delete_object(Bucket=self.location.bucket, Key=self._key(name))
        except (ClientError, BotoCoreError) as error:
            raise self._fail(name, error) from None

    def check_reachable(self, create: bool = False) -> None:
        """Fail in one line, within bounded time, when the bucket is missing, the credentials are refused or the
        endpoint does not answer. A local directory must exist, unless `create` (then it is made)."""
        if not self.location.is_s3:
            if create:
                os.makedirs(self.location.url, exist_ok=True)
            elif not os.path.isdir(self.location.url):
                raise ConfigError(f"{self.location.url} is not a directory")
            return
        try:
            self.client.head_bucket(Bucket=self.location.bucket)
        except ClientError as error:
            if str(error.response.get("Error", {}).get("Code")) in ("404", "NoSuchBucket"):
                where = f"{self.location.url}: the bucket {self.location.bucket} does not exist"
                raise StorageError(f"{where} at {endpoint(self.client)}") from None
            raise self._fail("", error) from None
        except BotoCoreError as error:
            raise self._fail("", error) from None
