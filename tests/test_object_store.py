"""The ObjectStore contract, kept by every store against its real server (SeaweedFS for s3://,
fake-gcs-server for gs://, Azurite for az://): whole objects, create-only writes with one
winner, ranged and whole reads, listings, deletion, and errors that name the URL and cause."""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import fresh_bucket

import areal_ckpt as ac
from areal_ckpt.storage.backends import store_of
from areal_ckpt.urls import parse_object_url


@pytest.fixture
def where(object_bucket):
    url = parse_object_url(f"{object_bucket}/trial", "test")
    return store_of(url), url


def test_objects_go_up_and_come_back_whole_and_in_ranges(where, tmp_path):
    store, url = where
    store.check_access()
    payload = os.urandom(3 << 20)
    (tmp_path / "file").write_bytes(payload)
    store.put_file(url.key("a", "file"), tmp_path / "file")
    assert store.put_bytes(url.key("a", "small"), b"hello")
    assert store.get_bytes(url.key("a", "small")) == b"hello"
    assert store.get_range(url.key("a", "file"), 1000, 5000) == payload[1000:6000]
    assert store.get_range(url.key("a", "file"), len(payload) - 10, 100) == payload[-10:]  # short at the end
    store.get_file(url.key("a", "file"), tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == payload
    listed = store.list_prefix(url.key("a") + "/")
    assert [(item.key, item.size) for item in listed] == [
        (url.key("a", "file"), len(payload)),
        (url.key("a", "small"), 5),
    ]
    assert all(item.modified > 0 for item in listed)


def test_a_missing_object_reads_as_none_and_deleting_it_is_no_error(where):
    store, url = where
    assert store.get_bytes(url.key("nothing")) is None
    store.put_bytes(url.key("there"), b"x")
    store.delete([url.key("there"), url.key("nothing")])
    assert store.list_prefix(url.key()) == []
    with pytest.raises(ac.CheckpointError, match=rf"{url.key('nothing')}.*no such object"):
        store.get_range(url.key("nothing"), 0, 1)


def test_create_only_has_exactly_one_winner_among_concurrent_writers(where):
    store, url = where
    for round_number in range(3):
        key = url.key(".commits", f"{round_number:012d}.json")
        start = threading.Barrier(6)

        def write(writer: int) -> bool:
            start.wait()
            return store.put_bytes(key, f"writer {writer}".encode(), create_only=True)

        with ThreadPoolExecutor(6) as pool:
            won = list(pool.map(write, range(6)))
        assert won.count(True) == 1
        assert store.get_bytes(key) == f"writer {won.index(True)}".encode()


def test_many_keys_are_deleted_in_batches(where):
    store, url = where
    keys = [url.key("many", f"{n:04d}") for n in range(300)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: store.put_bytes(key, b"."), keys))
    assert len(store.list_prefix(url.key("many") + "/")) == 300
    store.delete(keys)
    assert store.list_prefix(url.key("many") + "/") == []


def test_an_aborted_writer_leaves_no_object(where):
    store, url = where
    writer = store.open_writer(url.key("torn"))
    writer.write(os.urandom(70 << 20))  # more than one part: the upload has begun
    writer.abort()
    assert store.get_bytes(url.key("torn")) is None
    assert store.list_prefix(url.key("torn")) == []


def test_a_missing_bucket_is_named(object_server, monkeypatch):
    for variable, value in object_server.environment().items():
        monkeypatch.setenv(variable, value)
    url = parse_object_url(f"{object_server.scheme}://no-such-bucket-here/x", "test")
    kind = "container" if object_server.scheme == "az" else "bucket"
    with pytest.raises(
        ac.CheckpointError, match=rf"{url.scheme}://no-such-bucket-here/.*{kind} 'no-such-bucket-here' does not exist"
    ):
        store_of(url).check_access()


def test_an_endpoint_where_nothing_listens_is_a_transient_error_saying_the_connection_was_refused(
    object_server, monkeypatch, caplog
):
    """It used to read "did not answer in time" (GCS) or "did not answer", as a stalled server
    does; so did GCS's warning before each retry."""
    monkeypatch.setenv("AREAL_CKPT_STORAGE_TIMEOUT", "1")  # GCS then retries for 4 s, not 30
    for variable, value in object_server.environment().items():
        monkeypatch.setenv(variable, value.replace(str(object_server.endpoint).rsplit(":", 1)[1], "9"))
    url = parse_object_url(f"{object_server.scheme}://some-bucket/x", "test")
    variable = {"s3": "AWS_ENDPOINT_URL", "gs": "STORAGE_EMULATOR_HOST", "az": "AZURE_STORAGE_CONNECTION_STRING"}
    with pytest.raises(
        ac.errors.TransientError,
        match=rf"cannot list {url.scheme}://some-bucket/ .*: the server refused the connection \(nothing listens there: "
        rf"a wrong endpoint, or the server is down\).*the endpoint comes from {variable[url.scheme]}",
    ):
        store_of(url).check_access()
    retries = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("areal_ckpt")]
    assert retries and not [message for message in retries if "did not answer" in message]


def test_missing_credentials_name_the_variables_to_set(monkeypatch, tmp_path):
    for variable in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(
        ac.CheckpointError,
        match=r"cannot reach az://ckpt/: no Azure storage account configured; set AZURE_STORAGE_CONNECTION_STRING, or "
        r"AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY",
    ):
        store_of(parse_object_url("az://ckpt/x", "test")).check_access()
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    with pytest.raises(
        ac.CheckpointError, match=r"gs://ckpt/ .*no credentials found; set GOOGLE_APPLICATION_CREDENTIALS"
    ):
        store_of(parse_object_url("gs://ckpt/x", "test")).check_access()


@pytest.mark.parametrize("scheme", ["s3", "az"])  # fake-gcs-server takes any caller: no key to get wrong
def test_a_wrong_key_is_access_denied_naming_the_variables_to_check(request, monkeypatch, scheme):
    """Azure used to say only "StorageErrorCode.AUTHORIZATION_FAILURE"; on S3 a store made with
    the wrong secret used to be kept when only the secret was set right."""
    import re

    server = request.getfixturevalue({"s3": "s3_server", "az": "azure_server"}[scheme])
    server.make_bucket("wrong-key")
    for variable, value in server.environment().items():
        monkeypatch.setenv(variable, value)
    if scheme == "s3":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")  # the key id right: only the secret changes back
        named = "AWS"
    else:
        wrong = re.sub(r"AccountKey=[^;]+", "AccountKey=" + "A" * 86 + "==", server.environment()[
            "AZURE_STORAGE_CONNECTION_STRING"])  # fmt: skip
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
        named = "AZURE_STORAGE_CONNECTION_STRING"
    with pytest.raises(
        ac.CheckpointError, match=rf"{scheme}://wrong-key/ at \S+: access denied .*check the credentials.*{named}"
    ):
        store_of(parse_object_url(f"{scheme}://wrong-key/x", "test")).check_access()
    for variable, value in server.environment().items():  # the hint followed: the right key
        monkeypatch.setenv(variable, value)
    store_of(parse_object_url(f"{scheme}://wrong-key/x", "test")).check_access()


@pytest.fixture
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a stalled store),
    until the test ends; its port."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_a_server_that_stops_answering_is_an_error_after_bounded_logged_waits(
    scheme, silent_server, monkeypatch, caplog
):
    endpoint = f"http://127.0.0.1:{silent_server}"
    environment = {
        "s3": {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"},
        "gs": {"STORAGE_EMULATOR_HOST": endpoint},
        "az": {
            "AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=http;AccountName=a;AccountKey=a2V5;"
            f"BlobEndpoint={endpoint}/a;"
        },
    }[scheme]
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AREAL_CKPT_STORAGE_TIMEOUT", "0.5")  # each request waits half a second for an answer
    url = parse_object_url(f"{scheme}://stalled/x", "test")
    with pytest.raises(ac.errors.TransientError, match=rf"cannot (list|connect to) {scheme}://stalled/"):
        store_of(url).check_access()
    retries = [r for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("areal_ckpt.storage")]
    assert len(retries) >= 2  # every wait before another try was logged
    counting = {"s3": r"attempt (\d+) of (\d+) failed", "az": r"try (\d+) of (\d+) more"}.get(scheme)
    if counting is not None:  # each try is logged as "N of M", and the client makes exactly the M it says
        counted = [re.search(counting, record.getMessage()) for record in retries]
        numbers = [(int(found[1]), int(found[2])) for found in counted if found]
        assert [number for number, _ in numbers] == list(range(1, numbers[0][1] + 1))


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "1e400", "nan", "1e10"])
@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_a_timeout_that_is_not_a_positive_number_of_at_most_a_day_is_a_config_error_naming_the_variable(
    monkeypatch, value, scheme
):
    # inf and 1e10 used to be taken, then every request failed with "timestamp out of range"
    monkeypatch.setenv("AREAL_CKPT_STORAGE_TIMEOUT", value)
    with pytest.raises(ac.ConfigError, match=rf"AREAL_CKPT_STORAGE_TIMEOUT='{value}': give the seconds .* at most"):
        store_of(parse_object_url(f"{scheme}://some-bucket/x", "test")).check_access()
    monkeypatch.setenv("AREAL_CKPT_STORAGE_TIMEOUT", "86400")  # the hint's largest value is taken
    store_of(parse_object_url(f"{scheme}://some-bucket/x", "test"))


def test_azurite_serves_the_suite_with_its_telemetry_off(azure_server, monkeypatch, request):
    """Azurite reports to Azure unless told not to, and then leaves its telemetry client's folder in
    the temporary folder and a config file beside its data; the suite's Azurite, having served a
    bucket, leaves neither (nothing the tests start reaches beyond 127.0.0.1)."""
    fresh_bucket(azure_server, "az", monkeypatch, request)
    assert not list((azure_server.folder / "tmp").glob("Microsoft-AzureMonitor-*"))
    assert not (azure_server.folder / "data" / "AzuriteConfig").exists()
