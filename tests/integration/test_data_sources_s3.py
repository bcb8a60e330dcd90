"""Sources on S3, through a real S3-compatible server on loopback (moto's): the same records as the local JSONL
manifest and WebDataset shards, resuming mid-shard with ranged GETs, and a missing object named."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
import torch

from omni_core.data.dataset import ManifestDataset
from omni_core.data.loader import PackedLoader
from omni_core.recipe.data_sections import DataConfig
from tests.helpers.data_sources import both_formats, records, same_docs


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[ManifestDataset, ManifestDataset]:
    """The same generated samples as a JSONL manifest and as WebDataset shards."""
    return both_formats(tmp_path_factory.mktemp("both"))


def upload(client, bucket: str, root: Path, prefix: str) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root)}")


def test_s3_sources_stream_from_a_real_s3_server(both, s3_endpoint, monkeypatch):
    jsonl, wds = both
    client = boto3.client("s3")
    client.create_bucket(Bucket="data")
    upload(client, "data", Path(jsonl.location).parent, "jsonl")
    upload(client, "data", Path(wds.location), "wds")
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the recipe's endpoint setting alone must find the server
    cfg = DataConfig(source="wds", s3_endpoint_url=s3_endpoint)
    remote = {"jsonl": ManifestDataset("s3://data/jsonl/manifest.jsonl", cfg.model_copy(update={"source": "jsonl"})),
              "wds": ManifestDataset("s3://data/wds", cfg)}
    assert remote["wds"].source.shards == [f"s3://data/wds/shard-{k:06d}.tar" for k in range(6)]
    for name, local in (("jsonl", jsonl), ("wds", wds)):
        a, b = records(local), records(remote[name])
        assert [(r.id, r.tokens) for r in a] == [(r.id, r.tokens) for r in b] and len(a) == 40
        for x, y in list(zip(a, b))[:6]:
            assert same_docs(local.decode(x), remote[name].decode(y)), (name, x.id)
    loader = PackedLoader(remote["wds"], cfg, "train", 0, 1, 1)
    stream = iter(loader)
    [next(stream) for _ in range(3)]
    state = loader.state_dict()
    assert state["consumers"][0]["position"][2] > 0
    expected = [next(stream).input_ids for _ in range(3)]
    resumed = PackedLoader(remote["wds"], cfg, "train", 0, 1, 1)
    resumed.load_state_dict(state)  # resumes with ranged GETs from the saved offsets
    assert all(torch.equal(x, y.input_ids) for x, (_, y) in zip(expected, zip(range(3), resumed)))
    with pytest.raises(FileNotFoundError, match="s3://data/nothing.jsonl"):
        ManifestDataset("s3://data/nothing.jsonl", cfg.model_copy(update={"source": "jsonl"}))
