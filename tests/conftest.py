"""Shared fixtures: real object stores on loopback and a small BF16 trainer.

* `moto_regions` (session): `moto_regions("eu-west-1")` starts (once) a moto S3 server for that
  simulated region on a free loopback port and returns a `Region`; moto does not replicate, so
  tests copy objects between regions themselves, in whatever order they want to test.
* `s3_run`: a fresh bucket in the default region; `.url` and `.options` (s3fs storage_options).
* `file_run`: a file:// run under tmp_path.
* `run_store`: parametrized over both, for tests that must hold on every backend.
* `rgw_run`: a fresh bucket on Ceph's S3 gateway (radosgw 16, a real S3 implementation), on a one-node
  Ceph cluster that the session starts once (tests/ceph.py); skipped, saying how to install Ceph, where
  its programs are missing.
* `every_store`: file, moto S3 and Ceph RGW, for the pipeline, race and fence tests (docs/STORES.md).
* `trainer`: factory for a small torch model with BF16 parameters and a deterministic step.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from codec import tensors as codec_tensors

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

_bucket_ids = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Region:
    """One simulated S3 region: a moto server on loopback."""

    name: str
    endpoint: str
    server: Any = field(repr=False)

    @property
    def options(self) -> dict:
        """s3fs storage_options for this region's endpoint."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing",
                "client_kwargs": {"region_name": self.name}}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name=self.name)

    def new_bucket(self, prefix: str = "relay") -> str:
        name = f"{prefix}-{os.getpid()}-{next(_bucket_ids)}"
        kw = {} if self.name == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": self.name}}
        self.client().create_bucket(Bucket=name, **kw)
        return name


@pytest.fixture(scope="session")
def moto_regions() -> Callable[[str], Region]:
    from moto.server import ThreadedMotoServer

    servers: dict[str, Region] = {}

    def get(name: str = "us-east-1") -> Region:
        if name not in servers:
            port = free_port()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            servers[name] = Region(name, f"http://127.0.0.1:{port}", server)
        return servers[name]

    yield get
    for region in servers.values():
        region.server.stop()


@dataclass
class RunStore:
    """A run location: `url` plus the storage_options to reach it."""

    kind: str
    url: str
    options: dict | None = None
    region: Region | None = None
    bucket: str | None = None


@pytest.fixture
def s3_run(moto_regions) -> RunStore:
    region = moto_regions("us-east-1")
    bucket = region.new_bucket()
    return RunStore("s3", f"s3://{bucket}/run", region.options, region, bucket)


@pytest.fixture
def file_run(tmp_path) -> RunStore:
    return RunStore("file", f"file://{tmp_path}/store/run")


@pytest.fixture(params=["file", "s3"])
def run_store(request) -> RunStore:
    return request.getfixturevalue(f"{request.param}_run")


@pytest.fixture(scope="session")
def ceph_rgw(tmp_path_factory):
    """A one-node Ceph cluster with radosgw on loopback, for the whole session; its daemons are stopped by PID."""
    import ceph

    missing = ceph.missing_binaries()
    if missing:
        pytest.skip(f"Ceph RGW tests need {', '.join(missing)}: {ceph.INSTALL}")
    cluster = ceph.start(str(tmp_path_factory.mktemp("ceph")))
    print(f"\nceph: radosgw at {cluster.endpoint}, started in {cluster.started_s:.1f} s")
    yield cluster
    cluster.stop()


@pytest.fixture
def rgw_run(ceph_rgw) -> RunStore:
    name = f"relay-{os.getpid()}-{next(_bucket_ids)}"
    ceph_rgw.client().create_bucket(Bucket=name)
    return RunStore("rgw", f"s3://{name}/run", ceph_rgw.options(), None, name)


@pytest.fixture(params=["file", "s3", "rgw"])
def every_store(request) -> RunStore:
    return request.getfixturevalue(f"{request.param}_run")


class Trainer:
    """A small MLP with BF16 parameters, stepped by SGD on random data (seeded, so reproducible)."""

    def __init__(self, seed: int = 0, lr: float = 3e-3, width: int = 96) -> None:
        torch.manual_seed(seed)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(48, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 16)).to(torch.bfloat16)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self) -> dict[str, torch.Tensor]:
        x = torch.randn(32, 48, generator=self.gen).to(torch.bfloat16)
        loss = self.model(x).float().pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return self.state()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


@pytest.fixture
def trainer() -> Callable[..., Trainer]:
    return Trainer


same_bits = codec_tensors.same_bits  # tests import it from here


def publish_steps(url: str, trainer: Callable[..., Trainer], steps: int, options: dict | None = None, seed: int = 3,
                  **kw: Any) -> list[dict[str, torch.Tensor]]:
    """Publish `steps` training steps (0..steps-1) with a fresh Trainer(seed); returns each step's state."""
    from relay.publisher import Publisher

    t = trainer(seed=seed)
    states = []
    with Publisher(url, storage_options=options, snapshot_every=3, background=False, **kw) as pub:
        for step in range(steps):
            state = t.state() if step == 0 else t.step()
            pub.publish(state, step)
            states.append(state)
    return states


@pytest.fixture
def bits_equal() -> Callable[[dict, dict], bool]:
    return same_bits
