"""Where checkpoints live: a local directory or an S3 prefix (MinIO and other S3-compatible stores too).

DCP always writes into a local directory; an S3 store then uploads each rank's own files (multipart for
large shards) and, after every rank is done, the manifest. Only a step whose manifest exists is complete:
a save interrupted at any point is never taken for a checkpoint. Loading from S3 first copies the step into
a local cache, because resharding under another plan may need every rank's shards.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from omni_core.data.storage import s3_client
from omni_core.recipe.schema import Recipe

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete (no manifest) or unreadable."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _step_of(name: str) -> int | None:
    match = _STEP.match(name)
    return int(match.group(1)) if match else None


def _rank_owns(name: str, rank: int) -> bool:
    """DCP names shard files `__<rank>_<n>.distcp`; rank 0 also writes `.metadata`; we add `rank<r>.pt`."""
    return name.startswith(f"__{rank}_") or name == f"rank{rank}.pt" or (rank == 0 and name == ".metadata")


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def location(self, step: int) -> str:
        return str(self.root / step_name(step))

    def local_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def publish(self, step: int, rank: int) -> None:
        """DCP wrote straight into the store."""

    def write_manifest(self, step: int, manifest: dict[str, Any]) -> None:
        tmp = self.local_dir(step) / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(self.local_dir(step) / MANIFEST)

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (_step_of(p.name) for p in self.root.iterdir() if (p / MANIFEST).is_file())
        return sorted(s for s in found if s is not None)

    def fetch(self, step: int) -> Path:
        return self.local_dir(step)

    def delete(self, step: int) -> None:
        shutil.rmtree(self.local_dir(step), ignore_errors=True)


class S3Store:
    """Checkpoints under s3://bucket/prefix/step_NNNNNN/; the endpoint comes from boto3's own settings
    (AWS_ENDPOINT_URL for MinIO or a loopback server, AWS_* credentials)."""

    def __init__(self, uri: str, cache: Path) -> None:
        parts = urlsplit(uri)
        if not parts.netloc:
            raise CheckpointError(f"checkpoint location {uri!r} names no bucket (expected s3://bucket/prefix)")
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        self.cache = cache

    def _client(self):
        return s3_client()

    def _key(self, step: int, name: str = "") -> str:
        return "/".join(p for p in (self.prefix, step_name(step), name) if p)

    def location(self, step: int) -> str:
        return f"{self.uri}/{step_name(step)}"

    def local_dir(self, step: int) -> Path:
        return self.cache / step_name(step)

    def publish(self, step: int, rank: int) -> None:
        from boto3.s3.transfer import TransferConfig

        client, config = self._client(), TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20)
        for path in sorted(self.local_dir(step).iterdir()):
            if _rank_owns(path.name, rank):
                client.upload_file(str(path), self.bucket, self._key(step, path.name), Config=config)

    def write_manifest(self, step: int, manifest: dict[str, Any]) -> None:
        body = json.dumps(manifest, indent=2).encode()
        self._client().put_object(Bucket=self.bucket, Key=self._key(step, MANIFEST), Body=body)
        (self.local_dir(step) / MANIFEST).write_bytes(body)

    def _objects(self, prefix: str) -> list[str]:
        paginator = self._client().get_paginator("list_objects_v2")
        return [
            o["Key"] for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix) for o in page.get("Contents", [])
        ]

    def steps(self) -> list[int]:
        root = f"{self.prefix}/" if self.prefix else ""
        found = set()
        for key in self._objects(root):
            parts = key[len(root) :].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST and (step := _step_of(parts[0])) is not None:
                found.add(step)
        return sorted(found)

    def fetch(self, step: int) -> Path:
        target = self.local_dir(step)
        if (target / MANIFEST).is_file():
            return target
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        client, prefix = self._client(), self._key(step) + "/"
        keys = self._objects(prefix)
        if prefix + MANIFEST not in keys:
            raise CheckpointError(f"{self.location(step)} has no {MANIFEST}: an incomplete save, refusing to load it")
        names = {key: key[len(prefix) :] for key in keys}
        strays = [key for key, name in names.items() if "/" in name or name in ("", ".", "..")]
        if strays:  # a checkpoint is a flat folder: such a key would be written elsewhere than the cache
            shutil.rmtree(target, ignore_errors=True)
            raise CheckpointError(
                f"{self.location(step)} holds objects that are not plain file names: "
                f"{', '.join(sorted(strays))}; refusing to load it"
            )
        for key in sorted(keys, key=lambda k: k.endswith(MANIFEST)):  # manifest last: the cache is complete or absent
            client.download_file(self.bucket, key, str(target / names[key]))
        return target

    def delete(self, step: int) -> None:
        keys = self._objects(self._key(step) + "/")
        client = self._client()
        manifest = [k for k in keys if k.endswith(MANIFEST)]
        for key in manifest + [k for k in keys if k not in manifest]:  # manifest first: never half-complete
            client.delete_object(Bucket=self.bucket, Key=key)
        shutil.rmtree(self.local_dir(step), ignore_errors=True)


CheckpointStore = LocalStore | S3Store


def open_store(location: str, cache: Path) -> CheckpointStore:
    """`s3://bucket/prefix` -> S3Store (staging and cache under `cache`); anything else is a local directory."""
    if location.startswith("s3://"):
        return S3Store(location, cache)
    if "://" in location:
        raise CheckpointError(f"checkpoint location {location!r}: only local paths and s3:// are supported")
    return LocalStore(Path(location))


def checkpoint_store(recipe: Recipe) -> CheckpointStore:
    """The recipe's store; S3 checkpoints are staged and cached under the experiment's output directory."""
    return open_store(recipe.checkpoint_dir(), checkpoint_cache(recipe))


def checkpoint_cache(recipe: Recipe) -> Path:
    return Path(recipe.experiment.output_dir) / recipe.experiment.name / f"ckpt-cache-{recipe.training_hash()}"


def split_location(location: str) -> tuple[str, int]:
    """`<store>/step_000050` -> (`<store>`, 50), for a checkpoint named by its full location."""
    root, _, name = location.rstrip("/").rpartition("/")
    step = _step_of(name)
    if step is None:
        raise CheckpointError(f"{location!r} does not name a checkpoint step directory (…/step_NNNNNN)")
    return root, step
