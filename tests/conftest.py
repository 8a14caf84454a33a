"""Shared fixtures: a tiny tokenizer and model built locally, and a checkpoint root per test."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import threads

threads.pin()  # before torch is imported: every process of the suite gets the same thread count

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no cloud SDK looks for a machine's metadata server (an address beyond 127.0.0.1) when a test
# leaves it without credentials
os.environ.setdefault("NO_GCE_CHECK", "true")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

from areal_ckpt.demo.tiny import build_model, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def make_model(tokenizer):
    """Build a tiny Qwen2 with a fixed seed (same weights for the same seed and overrides)."""

    def build(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        return build_model(len(tokenizer), **overrides)

    return build


@pytest.fixture
def fileroot(tmp_path: Path) -> Path:
    root = tmp_path / "fileroot"
    root.mkdir()
    return root


@pytest.fixture(autouse=True)
def _library_logs(caplog):
    caplog.set_level(logging.INFO, logger="areal_ckpt")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """Output of the uninterrupted single-process recover_job run (sync dumps), shared by the
    tests that compare a killed-and-resumed run with it."""
    from recovery_runs import run_job

    base = tmp_path_factory.mktemp("reference")
    run_job(base / "root", base / "out")
    return base / "out"


@pytest.fixture(scope="session")
def reference_run_fsdp2(tmp_path_factory) -> Path:
    """Output of the uninterrupted 2-rank FSDP2 recover_job run (sync dumps)."""
    from recovery_runs import run_job

    base = tmp_path_factory.mktemp("reference-fsdp2")
    run_job(base / "root", base / "out", world_size=2, wrap="fsdp2")
    return base / "out"


_BUCKETS = itertools.count()


def _serving(server):  # type: ignore[no-untyped-def]
    """Start ``server``, hand it to the session, stop it at the end."""
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS on 127.0.0.1) for the tests that only read and write."""
    from seaweed import SeaweedServer

    yield from _serving(SeaweedServer(tmp_path_factory.mktemp("seaweed")))


def fresh_bucket(server, scheme: str, monkeypatch, request) -> str:
    """A new bucket on ``server`` named after the test, its client settings in this process's
    environment; its URL."""
    import re

    readable = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{readable}-{next(_BUCKETS)}-{os.getpid() % 10000}"
    server.make_bucket(name)
    for variable, value in server.environment().items():
        monkeypatch.setenv(variable, value)
    return f"{scheme}://{name}"


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request):
    """A fresh bucket on the shared S3 server; returns its ``s3://`` URL."""
    return fresh_bucket(s3_server, "s3", monkeypatch, request)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """One real Google Cloud Storage emulator (fake-gcs-server on 127.0.0.1)."""
    from cloud_emulators import FakeGCSServer

    yield from _serving(FakeGCSServer(tmp_path_factory.mktemp("fake-gcs")))


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """One real Azure Blob emulator (Azurite on 127.0.0.1)."""
    from cloud_emulators import AzuriteServer

    yield from _serving(AzuriteServer(tmp_path_factory.mktemp("azurite")))


#: Every object store the suite runs against, by URL scheme, and the fixture of its server.
OBJECT_SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}


@pytest.fixture(params=sorted(OBJECT_SERVERS))
def object_server(request):
    """The real server of each object store in turn (a test using it runs once per scheme);
    ``.scheme`` says which."""
    server = request.getfixturevalue(OBJECT_SERVERS[request.param])
    server.scheme = request.param
    return server


@pytest.fixture
def object_bucket(object_server, monkeypatch, request):
    """A fresh bucket (container) on each object store in turn, its client settings in this
    process's environment; returns its URL (``s3://``, ``gs://``, ``az://``)."""
    return fresh_bucket(object_server, object_server.scheme, monkeypatch, request)


@dataclass(frozen=True)
class PersistentRoot:
    """Where a tiered trial persists behind its local tier, for the tests that run on each:
    ``root`` (a bucket's URL, or a folder standing for a shared file system) and the client
    settings a spawned job needs (``environment``; none for a folder)."""

    kind: str
    root: str
    environment: dict[str, str]


@pytest.fixture(params=[*sorted(OBJECT_SERVERS), "posix"])
def persistent_root(request, tmp_path, monkeypatch) -> PersistentRoot:
    """Each place a trial can persist behind a local tier in turn: every object store (a fresh
    bucket) and a folder (a shared file system such as Lustre or NFS)."""
    if request.param == "posix":
        return PersistentRoot("posix", str(tmp_path / "shared"), {})
    server = request.getfixturevalue(OBJECT_SERVERS[request.param])
    bucket = fresh_bucket(server, request.param, monkeypatch, request)
    return PersistentRoot(request.param, bucket, server.environment())


@pytest.fixture
def own_s3_server(tmp_path, monkeypatch):
    """A server of this test's own, which it may kill and start again; its client settings in
    this process's environment."""
    from seaweed import SeaweedServer

    server = SeaweedServer(tmp_path / "own-server")
    server.start()
    for variable, value in server.environment().items():
        monkeypatch.setenv(variable, value)
    yield server
    server.stop()


#: The stores whose test server keeps what it acknowledged across a SIGKILL. Azurite is not one:
#: it holds its blob index in memory and saves it now and then, so after a kill it forgets
#: containers and commits it had acknowledged (seen here: "container ... does not exist").
CRASH_DURABLE_SERVERS = ("gs", "s3")


@pytest.fixture(params=CRASH_DURABLE_SERVERS)
def own_object_server(request, tmp_path, monkeypatch):
    """A server of this test's own for each store whose test server survives a SIGKILL
    (:data:`CRASH_DURABLE_SERVERS`; ``.scheme`` says which), which it may kill and start again
    (the same port and data folder); its client settings in this process's environment, and
    requests that wait 2 s for an answer (so retries against a killed server end within seconds)."""
    from cloud_emulators import FakeGCSServer
    from seaweed import SeaweedServer

    kinds = {"s3": SeaweedServer, "gs": FakeGCSServer}
    server = kinds[request.param](tmp_path / "own-server")
    server.scheme = request.param
    server.start()
    for variable, value in server.environment().items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AREAL_CKPT_STORAGE_TIMEOUT", "2")
    yield server
    server.stop()
