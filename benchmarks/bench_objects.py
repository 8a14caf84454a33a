"""`make bench` (sixth part): exports, recovery dumps and loads on object storage against each
store's client's own raw transfer of the same bytes, for every store.

Real servers on 127.0.0.1, their data on this machine's disk: SeaweedFS (`weed mini`) for
`s3://`, fake-gcs-server for `gs://`, Azurite for `az://`; one process. Each round, interleaved:
an HF export of a Qwen2-shaped fp32 model (sync, `Saver`, 1 GB shards) against the client's raw
upload of one file of the export's size; a sync recovery dump (weights and AdamW state) against
a raw upload of the dump's bytes; a load of that dump on a fresh staging folder (every file
downloaded, then verified and loaded) against a raw download of one object of the same size;
each pair's order alternates by round. A control pairs two raw uploads. The raw side is the
store's `put_file` / `get_file`: the SDK's own file transfer with the settings ours uses (boto3
`upload_file` / `download_file`, 64 MiB parts, 8 at once; google-cloud-storage's
`upload_from_filename` / `download_to_filename`; azure-storage-blob's `upload_blob` /
`download_blob`, 8 at once). Ratios are raw seconds over ours per round (1.0 = as fast as the
raw client), reported as median and range.

    python benchmarks/bench_objects.py --size 400 --rounds 5 --out docs/benchmarks-objects.md
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    machine_description,
    model_of_size,
    publish,
    scratch_folder,
    size_and_rounds,
    state_bytes,
    state_tensors,
)

import areal_ckpt as ac
from areal_ckpt.storage.backends import store_of
from areal_ckpt.storage.objects import ObjectStore
from areal_ckpt.urls import parse_object_url

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cloud_emulators import AzuriteServer, FakeGCSServer  # noqa: E402  (the tests' real servers)
from seaweed import SeaweedServer  # noqa: E402

SERVERS = {"s3": SeaweedServer, "gs": FakeGCSServer, "az": AzuriteServer}
#: A store's state size is its part of --size: the emulators are far slower than SeaweedFS here.
SHARE = {"s3": 1.0, "gs": 0.25, "az": 0.25}

SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=1000, train_batch_size=2)
TOKENS = torch.arange(32).reshape(2, 16)


def _paired(ours_first: bool, ours: Callable[[], None], raw: Callable[[], None]) -> None:
    """Run ``ours`` and ``raw`` back to back, ``ours`` first when ``ours_first``."""
    for run in (ours, raw) if ours_first else (raw, ours):
        run()


def _raw_put(store: ObjectStore, size: int, work: Path) -> float:
    source = work / "raw.bin"
    if not source.exists() or source.stat().st_size != size:
        with open(source, "wb") as handle:  # incompressible; read from the page cache, as ours reads its staging copy
            for start in range(0, size, 64 << 20):
                handle.write(os.urandom(min(64 << 20, size - start)))
    start = time.perf_counter()
    store.put_file(f"raw/{size}", source)
    return time.perf_counter() - start


def _raw_get(store: ObjectStore, size: int, work: Path) -> float:
    start = time.perf_counter()
    store.get_file(f"raw/{size}", work / "raw.down")
    return time.perf_counter() - start


def server_and_state(prefix: str, mib: int, scheme: str = "s3"):  # type: ignore[no-untyped-def]
    """A scratch folder, a started server of ``scheme``'s store (its bucket ``bench``, its
    settings in this process's environment), the library's store of that bucket (the raw
    client), and an fp32 model of ``mib`` MiB with one AdamW step taken."""
    work = scratch_folder(prefix)
    server = SERVERS[scheme](work / "server")
    server.start()
    os.environ.update(server.environment())
    server.make_bucket("bench")
    model = model_of_size(mib, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(input_ids=TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    return work, server, store_of(parse_object_url(f"{scheme}://bench", "bench")), model, optimizer


def measure(scheme: str, mib: int, rounds: int) -> list[dict[str, float]]:
    """One row per round: seconds of ours and of the raw client for export, dump and load."""
    work, server, client, model, optimizer = server_and_state(f"bench-{scheme}-", mib, scheme)
    engine = ac.TorchEngine(model, optimizer)
    rows = []
    try:
        for index in range(rounds):
            row: dict[str, float] = {}
            ours_first = index % 2 == 0  # the order within each pair alternates by round
            fields = dict(
                experiment_name="bench", trial_name=f"r{index}", user="bench", fileroot=f"{scheme}://bench/runs"
            )
            saver = ac.Saver(ac.SaverConfig(**fields, mode="sync", max_shard_size="1GB"), SPEC)
            export_bytes = state_bytes(model)  # what the export writes, to within its small files

            def export() -> None:
                start = time.perf_counter()
                saver.save(engine, 0, 0, 0, force=True)
                row["export"] = time.perf_counter() - start
                row["export bytes"] = saver.last_metrics["bytes"]
                saver.finalize()

            _paired(ours_first, export, lambda: row.update({"raw export": _raw_put(client, export_bytes, work)}))

            config = ac.RecoverConfig(**fields, mode="sync", staging_dir=str(work / f"disk{index}"))
            dump_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer))

            def dump() -> None:
                handler = ac.RecoverHandler(config, SPEC)
                handler.dump(engine, ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=500), force=True)
                row["dump"], row["dump bytes"] = handler.last_metrics["time/saving"], handler.last_metrics["bytes"]
                handler.close()

            _paired(ours_first, dump, lambda: row.update({"raw dump": _raw_put(client, dump_bytes, work)}))

            def load() -> None:
                loader = ac.RecoverHandler(config.model_copy(update={"staging_dir": str(work / f"new{index}")}), SPEC)
                start = time.perf_counter()
                loader.load(engine)
                row["load"] = time.perf_counter() - start
                loader.close()

            _paired(ours_first, load, lambda: row.update({"raw load": _raw_get(client, dump_bytes, work)}))
            # the control: the raw upload against itself, to read the other rows' spread against
            row["control"] = _raw_put(client, dump_bytes, work)
            row["raw control"] = _raw_put(client, dump_bytes, work)
            rows.append(row)
            for folder in (f"disk{index}", f"new{index}"):
                shutil.rmtree(work / folder, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _ratio(rows: list[dict[str, float]], what: str) -> str:
    ratios = [row[f"raw {what}"] / row[what] for row in rows]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def report(measured: dict[str, tuple[int, list[dict[str, float]]]], rounds: int) -> str:
    lines = [
        "# Object storage: against each store's raw client",
        "",
        f"Measured by `benchmarks/bench_objects.py --size {measured['s3'][0] if 's3' in measured else '?'} --rounds {rounds}` "
        f"on {machine_description()}, {time.strftime('%Y-%m-%d')}: one process, a fp32 Qwen2-shaped model with AdamW "
        "state, each store's server on 127.0.0.1 sharing the machine's two cores and disk: SeaweedFS 4.48 (`weed "
        "mini`) for `s3://`, fake-gcs-server (filesystem backend) for `gs://`, Azurite 3.37 for `az://`; the two "
        "emulators are far slower than SeaweedFS here, so their state is a quarter of the size. Ours includes "
        "everything a user waits for (export: the state gathered, shards uploaded from memory as they are made, "
        "small files, manifest, commit record; dump: the same for the DCP data file, the local commit of the small "
        "files, then their upload and the commit record; load: the download of every file into a fresh staging "
        "folder, checksums, the load). Raw: the store's `put_file` / `get_file` (the SDK's own file transfer, "
        "same settings) of the same number of bytes from / to the page cache, right before or after ours (the "
        "order alternating by round). Ratio = raw seconds / ours, per round: median (range); above 1 is faster "
        "than the raw client. The control row pairs two raw uploads of the dump's size: its range is how far a "
        "ratio moves here with nothing changed.",
        "",
        "| store | operation | bytes | ours (s) | raw client (s) | raw / ours |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for scheme, (_, rows) in measured.items():
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        for what, size in (("export", "export bytes"), ("dump", "dump bytes"), ("load", "dump bytes")):
            lines.append(
                f"| `{scheme}://` | {what} | {median[size] / 2**20:.0f} MiB | {median[what]:.2f} | "
                f"{median[f'raw {what}']:.2f} | {_ratio(rows, what)} |"
            )
        lines.append(
            f"| `{scheme}://` | control: raw upload against raw upload | {median['dump bytes'] / 2**20:.0f} MiB | "
            f"{median['control']:.2f} | {median['raw control']:.2f} | {_ratio(rows, 'control')} |"
        )
    lines += [
        "",
        "The goal is 0.9x or better for each row. History on this machine (S3): 0.76x (export) and 0.78x (dump) "
        "when each shard was written to a local staging file, fsync'd, then uploaded (2026-11-25); 0.82x and "
        "0.85x once each 64 MiB part went up as the writer filled it; then parts stopped being copied into "
        "fresh 64 MiB buffers (each took ~80 ms to fault in on this VM, some 20 per dump) and became lists of "
        "views of the tensors' own memory, read by the upload as they are. A load can come out faster than the "
        "raw download of one object of the same size (both fetch large objects as parallel ranged reads); "
        "read it as: not slower.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = size_and_rounds(__doc__, 400, "MiB of fp32 weights (S3; a quarter of it for GCS and Azure)")
    parser.add_argument("--stores", default="s3,gs,az", help="comma-separated schemes to measure")
    args = parser.parse_args(argv)
    measured = {}
    for scheme in args.stores.split(","):
        mib = max(16, int(args.size * SHARE[scheme]))
        measured[scheme] = (mib, measure(scheme, mib, args.rounds))
    return publish(report(measured, args.rounds), args.out)


if __name__ == "__main__":
    sys.exit(main())
