"""Where dataset bytes come from: local paths, or `s3://bucket/key` through boto3 on any S3-compatible endpoint
(AWS, MinIO). Shards are streamed from a byte offset with a ranged GET, never downloaded whole; a missing
object raises FileNotFoundError exactly like a missing local file, so callers handle one error."""

from __future__ import annotations

import io
import mmap
import os
import posixpath
import socket
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

AWS_S3_ENDPOINT = "https://s3.amazonaws.com"
CONNECT_TIMEOUT_S = 3.0
# botocore's standard retry mode: throttling, 5xx, refused and reset connections retried with exponential backoff
# and jitter (each wait <= 20 s), so 8 attempts ride out about a minute of an endpoint's absence. AWS_RETRY_MODE
# and AWS_MAX_ATTEMPTS, when set, win.
S3_RETRY_MODE = "standard"
S3_MAX_ATTEMPTS = 8


def is_s3(location: str) -> bool:
    return location.startswith("s3://")


def s3_endpoint(endpoint_url: str = "") -> str:
    """The endpoint boto3 talks to: `endpoint_url` (data.s3_endpoint_url), else its environment's
    ($AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL), else AWS's."""
    env = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return endpoint_url or env or AWS_S3_ENDPOINT


def endpoint_unreachable(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why no server accepts a connection at the URL's host and port, or None when one does: an answer in
    seconds where boto3 would retry for minutes."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return None
    except (OSError, ValueError) as error:
        return f"S3 endpoint {url} is not reachable ({getattr(error, 'strerror', None) or error})"


def s3_client(endpoint_url: str = "") -> Any:
    """A boto3 S3 client that retries transient errors with backoff (S3_MAX_ATTEMPTS) at `endpoint_url` (or
    boto3's own settings: AWS_ENDPOINT_URL, credentials from the environment or a profile)."""
    import boto3
    from botocore.config import Config

    retries = {
        "mode": os.environ.get("AWS_RETRY_MODE") or S3_RETRY_MODE,
        "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or S3_MAX_ATTEMPTS),
    }
    return boto3.client("s3", endpoint_url=endpoint_url or None, config=Config(retries=retries))


def join(folder: str, relative: str) -> str:
    """`relative` resolved against a folder location (local or s3://)."""
    if not is_s3(folder):
        return str(Path(folder) / relative)
    bucket, key = _bucket_key(folder)
    return f"s3://{bucket}/{posixpath.normpath(posixpath.join(key, relative)).lstrip('/')}"


def parent(location: str) -> str:
    return posixpath.dirname(location) if is_s3(location) else str(Path(location).parent)


def _bucket_key(location: str) -> tuple[str, str]:
    bucket, _, key = location[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{location}: an S3 location needs a bucket: s3://bucket/key")
    return bucket, key


class Storage:
    """Reads locations; the boto3 client is made lazily, once per process (loader workers fork)."""

    def __init__(self, endpoint_url: str = "") -> None:
        self.endpoint_url = endpoint_url
        self._client: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "_client": None, "_pid": -1}

    def s3(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            self._client = s3_client(self.endpoint_url)
            self._pid = os.getpid()
        return self._client

    def shards(self, location: str, suffix: str) -> list[str]:
        """The location itself if it ends with `suffix`, else the files ending with it directly inside the
        folder (or S3 prefix taken as a folder), sorted by name."""
        if location.endswith(suffix):
            if not self.exists(location):
                raise FileNotFoundError(f"{location}: no such file")
            return [location]
        if not is_s3(location):
            folder = Path(location)
            if not folder.is_dir():
                raise FileNotFoundError(f"{location}: no such file or folder")
            return sorted(str(p) for p in folder.iterdir() if p.name.endswith(suffix) and p.is_file())
        bucket, prefix = _bucket_key(location)
        prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        keys = []
        for page in self.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
            keys += [obj["Key"] for obj in page.get("Contents", []) if obj["Key"].endswith(suffix)]
        return [f"s3://{bucket}/{key}" for key in sorted(keys)]

    def exists(self, location: str) -> bool:
        """Whether a file (or S3 object) is there."""
        return self._exists_s3(location) if is_s3(location) else Path(location).is_file()

    def _exists_s3(self, location: str) -> bool:
        bucket, key = _bucket_key(location)
        try:
            self.s3().head_object(Bucket=bucket, Key=key)
        except Exception as err:
            if _error_code(err) in ("404", "NoSuchKey", "NoSuchBucket"):
                return False
            raise
        return True

    def open(self, location: str, offset: int = 0) -> BinaryIO:
        """A binary stream from byte `offset` to the end."""
        if not is_s3(location):
            stream = open(location, "rb")  # noqa: SIM115 - the caller closes it
            stream.seek(offset)
            return stream
        bucket, key = _bucket_key(location)
        try:
            return self.s3().get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-")["Body"]
        except Exception as err:
            code = _error_code(err)
            if code == "InvalidRange":  # offset at the very end: nothing left to read
                return io.BytesIO()
            if code in ("NoSuchKey", "404", "NoSuchBucket"):
                raise FileNotFoundError(location) from err
            raise

    def view(self, location: str) -> bytes | mmap.mmap:
        """A whole file to scan (a `.json` array of records): a local file memory-mapped, so that every process
        reading it (ranks, loader workers) shares the page cache's one copy instead of holding its own; an S3
        object read whole."""
        if is_s3(location):
            return self.read(location)
        with open(location, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                return b""  # mmap refuses an empty file
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, location: str) -> bytes:
        """A whole (small) file: one image or audio clip."""
        if not is_s3(location):
            return Path(location).read_bytes()
        body = self.open(location)
        try:
            return body.read()
        finally:
            body.close()


def _error_code(err: Exception) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))
