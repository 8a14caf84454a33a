"""`make torture`'s object-storage rows: jobs that dump or export to a real object store forever
(SeaweedFS for s3://, fake-gcs-server for gs://, Azurite for az://, each on 127.0.0.1),
SIGKILLed at a random instant after their first commit; or the server SIGKILLed at a random
instant under a dumping job and started again (S3 and GCS; Azurite keeps its index in memory and
saves it now and then, so a SIGKILL of Azurite itself loses what the store had acknowledged). After each
kill a fresh process on an empty staging folder (a node that never saw the job) loads what the
bucket holds; the weights must be those of the step it names. A tiered job (``recover.local_dir``)
is also resumed on its own node, from whichever tier holds the newer commit, which must not be
older than the bucket's."""

from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import torch
from cloud_emulators import AzuriteServer, FakeGCSServer
from distributed import run_distributed, start_processes
from object_helpers import keys_under
from recover_fixtures import SPEC, make_setup, step_info
from seaweed import SeaweedServer

import areal_ckpt as ac

BIG = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3)  # ~2 MB of weights
BUCKET = "torture"
AHEAD = "the local tiers were ahead of the bucket"


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)


SERVERS = {"s3": SeaweedServer, "gs": FakeGCSServer, "az": AzuriteServer}
#: What each store's rows kill: (kind, ranks, victim).
ROWS = {
    "s3": [
        ("recover", 1, "job"),
        ("recover", 2, "job"),
        ("saver", 2, "job"),
        ("recover", 1, "server"),
        ("tiered", 1, "job"),
        ("tiered", 2, "job"),
        ("tiered", 1, "server"),
    ],
    "gs": [
        ("recover", 1, "job"),
        ("recover", 2, "job"),
        ("saver", 2, "job"),
        ("recover", 1, "server"),
        ("tiered", 1, "job"),
    ],
    "az": [("recover", 1, "job"), ("recover", 2, "job"), ("saver", 2, "job"), ("tiered", 1, "job")],
}


def _fields(trial: str) -> dict:
    """The trial's config fields; its store from the ``TORTURE_BUCKET`` URL in the environment."""
    return dict(experiment_name="exp", trial_name=trial, fileroot=f"{os.environ['TORTURE_BUCKET']}/runs", user="tester")


def object_job(rank: int, world: int, environment: dict, trial: str, kind: str, staging: str) -> None:
    """Step s sets every weight to s, then dumps (recover) or exports (saver), forever."""
    os.environ.update(environment)
    setup = make_setup(**BIG)
    node = f"{staging}/node{rank}"
    if kind == "recover":
        handler = ac.RecoverHandler(ac.RecoverConfig(**_fields(trial), mode="sync", staging_dir=node), SPEC)
    elif kind == "tiered":
        handler = ac.RecoverHandler(ac.RecoverConfig(**_fields(trial), mode="sync", local_dir=node), SPEC)
    else:
        handler = ac.Saver(ac.SaverConfig(**_fields(trial), mode="sync", max_shard_size="1MB", staging_dir=node), SPEC)
    for step in range(10**6):
        _fill(setup.model, float(step))
        try:
            if kind != "saver":
                handler.dump(setup.engine, step_info(step), force=True)
            else:
                handler.save(setup.engine, 0, step, step, force=True)
        except ac.CheckpointError:  # the server died under it: the previous commit stands; go on
            time.sleep(0.05)


def _committed(trial: str, kind: str) -> bool:
    prefix = f"runs/checkpoints/tester/exp/{trial}/" + (
        "default/.commits/" if kind == "saver" else ".recover/.commits/"
    )
    try:
        return bool(keys_under(os.environ["TORTURE_BUCKET"], prefix))
    except Exception:  # the server is being restarted
        return False


def _resume(config: ac.RecoverConfig) -> tuple[float | None, str, list[torch.Tensor]]:
    """Load ``config``'s trial in this process: the step it names (None: nothing or an error,
    explained) and the weights."""
    setup = make_setup(seed=1, **BIG)
    handler = ac.RecoverHandler(config, SPEC)
    try:
        info = handler.load(setup.engine, drop_rank_state=True)  # a 2-rank dump, loaded by one process
        if info is None:
            return None, "no checkpoint after a commit", []
        return float(info.last_step_info.global_step), "", list(setup.model.parameters())
    except ac.CheckpointError as error:
        return None, str(error)[:300], []
    finally:
        handler.close()


def resume_on_nodes(rank: int, world: int, environment: dict, trial: str, staging: str, report: str) -> None:
    """Resume a tiered trial on the job's own nodes (rank r on ``{staging}/node{r}``, as the job
    ran) and write the step it names and whether every weight equals it to ``{report}{rank}.json``."""
    os.environ.update(environment)
    config = ac.RecoverConfig(**_fields(trial), mode="sync", local_dir=f"{staging}/node{rank}")
    step, why, weights = _resume(config)
    exact = step is not None and all(bool((w == step).all()) for w in weights)
    Path(f"{report}{rank}.json").write_text(json.dumps({"step": step, "why": why, "exact": exact}))


def _check(trial: str, kind: str, work: Path, staging: str, world: int) -> tuple[str, str]:
    """What a fresh node finds (and, tiered, the job's own nodes, each rank on its ``staging``
    folder): ``resumed_correctly``, ``lost`` (nothing, an error, or an older commit than the
    bucket's) or ``wrong`` (weights of another step)."""
    if kind != "saver":
        fresh = ac.RecoverConfig(**_fields(trial), mode="sync", staging_dir=str(work / f"check-{trial}"))
        step, why, weights = _resume(fresh)
        if step is None:
            return "lost", why
        if kind == "tiered":  # the job's own nodes: their local tiers or the bucket, the newer
            if not all(bool((w == step).all()) for w in weights):
                return "wrong", f"the bucket's weights do not all equal step {step:.0f}"
            report = str(work / f"nodes-{trial}-rank")
            run_distributed(resume_on_nodes, world, dict(os.environ), trial, staging, report)
            for rank in range(world):
                found = json.loads(Path(f"{report}{rank}.json").read_text())
                if found["step"] is None or found["step"] < step:
                    return "lost", found["why"] or f"rank {rank} resumed {found['step']}, the bucket holds {step:.0f}"
                if not found["exact"]:
                    return "wrong", f"rank {rank}: weights do not all equal step {found['step']:.0f}"
            return "resumed_correctly", AHEAD if found["step"] > step else ""
    else:
        model = f"{os.environ['TORTURE_BUCKET']}/runs/checkpoints/tester/exp/{trial}/default"
        try:
            folder = ac.download_export(model, Path(tempfile.mkdtemp(prefix=f"check-{trial}-", dir=work)) / "export")
        except ac.CheckpointError as error:
            return "lost", str(error)[:300]
        step = float(json.loads((folder / "areal_ckpt_manifest.json").read_text())["step"]["global_step"])
        from safetensors.torch import load_file

        weights = [t for file in folder.glob("*.safetensors") for t in load_file(file).values()]
    if not weights or not all(bool((w == step).all()) for w in weights):
        return "wrong", f"weights do not all equal step {step:.0f}"
    return "resumed_correctly", ""


def scenario_objects(trials: int, rng: random.Random, work: Path, select: str | None = None) -> list:
    """Every store's rows (``{scheme}-kill-...``) whose id contains ``select`` (all when it is
    None or a prefix of ``{scheme}-kill``)."""
    rows = []
    for scheme in SERVERS:
        prefix = f"{scheme}-kill"
        if select is None or select in prefix or select.startswith(prefix):
            rows += scenario_store(scheme, trials, rng, work, select)
    return rows


def scenario_store(scheme: str, trials: int, rng: random.Random, work: Path, select: str | None = None) -> list:
    """Rows of one store: SIGKILL of a dumping / exporting job (1 and 2 ranks), SIGKILL of the
    server; those whose id contains ``select`` (all when it is a prefix of their ids or None)."""
    from torture import Row

    server = SERVERS[scheme](work / f"{scheme}-server")
    server.start()
    server.make_bucket(BUCKET)
    environment = {**server.environment(), "TORTURE_BUCKET": f"{scheme}://{BUCKET}"}
    os.environ.update(environment)  # for the checks made in this process
    rows = []
    try:
        for kind, world, victim in ROWS[scheme]:
            row = Row(f"{scheme}-kill-{victim}-{kind}-{world}")
            if select is not None and select not in row.scenario and not f"{scheme}-kill".startswith(select):
                continue
            ahead = 0
            for index in range(trials):
                trial = f"{kind}{world}{victim}{index}"
                staging = str(work / f"staging-{scheme}-{trial}")
                processes = start_processes(object_job, world, environment, trial, kind, staging)
                try:
                    deadline = time.monotonic() + 120
                    while not _committed(trial, kind) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.0, 0.5))
                    if victim == "server":
                        server.kill()
                        time.sleep(rng.uniform(0.0, 0.5))  # the job fails its dumps meanwhile
                        server.start()
                        time.sleep(rng.uniform(0.0, 0.5))  # and may commit again
                    for process in processes:
                        os.kill(process.pid, signal.SIGKILL)
                finally:
                    for process in processes:
                        process.join(30)
                outcome, note = _check(trial, kind, work, staging, world)
                ahead += note == AHEAD
                row.record(outcome, note)
            if kind == "tiered":
                row.notes.append(
                    f"{ahead} of {trials} resumed on the job's own nodes from a local generation newer than the bucket's"
                )
            rows.append(row)
    finally:
        server.stop()
    return rows
