"""`make torture`'s peer-copy rows (``peers-kill-{ranks}``, ``peers-kill-4-on-2-nodes``): a tiered
job on 2 or 4 ranks, each rank its own simulated node (its own ``local_dir`` folder), or 4 ranks
sharing 2 nodes two by two, in front of a shared folder, with
``local_replicas`` 1 and ``upload_every`` 4, dumping forever (step s sets every weight to s);
SIGKILLed at a random instant once the copies of a first commit are complete, then up to one
node's local tier (chosen at random, or none) deleted before the restart on the same nodes. A
resume must name a step no older than the shared folder's newest, nor than the newest generation
whose copies were complete on the disks at the kill (read by the test itself), and load exactly
that step's weights (``lost`` / ``wrong`` otherwise); the notes count the resumes from the nodes (newer than the shared folder,
so from the local tiers and their copies) and from the shared folder."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
from distributed import run_distributed, start_processes
from recover_fixtures import SPEC, make_setup, step_info

import areal_ckpt as ac
from areal_ckpt.paths import RECOVER_MANIFEST, generation_step
from areal_ckpt.publish import read_manifest

BIG = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3)  # ~2 MB of weights
COPIES = 1
UPLOAD_EVERY = 4


def _config(work: str, trial: str, node: int) -> ac.RecoverConfig:
    return ac.RecoverConfig(
        experiment_name="exp",
        trial_name=trial,
        fileroot=f"{work}/shared",
        user="tester",
        mode="sync",
        local_dir=f"{work}/{trial}-local/node{node}",
        local_replicas=COPIES,
        upload_every=UPLOAD_EVERY,
    )


def peer_job(rank: int, world: int, work: str, trial: str, per_node: int) -> None:
    """Step s sets every weight to s (each rank its own share of the model), then dumps, forever;
    ``per_node`` ranks share each node."""
    setup = make_setup(**BIG)
    handler = ac.RecoverHandler(_config(work, trial, rank // per_node), SPEC)
    for step in range(10**6):
        with torch.no_grad():
            for parameter in setup.model.parameters():
                parameter.fill_(float(step))
        handler.dump(setup.engine, step_info(step), force=True)


def resume_peers(rank: int, world: int, work: str, trial: str, per_node: int, report: str) -> None:
    """Resume on the same nodes; write the step named and whether every weight equals it."""
    setup = make_setup(seed=1, **BIG)
    handler = ac.RecoverHandler(_config(work, trial, rank // per_node), SPEC)
    try:
        info = handler.load(setup.engine)
        step = None if info is None else float(info.last_step_info.global_step)
        why = "" if info is not None else "no checkpoint after a commit"
    except ac.CheckpointError as error:
        step, why = None, str(error)[:300]
    exact = step is not None and all(bool((w == step).all()) for w in setup.model.parameters())
    Path(f"{report}{rank}.json").write_text(json.dumps({"step": step, "why": why, "exact": exact}))
    handler.close()


def _shared_step(work: Path, trial: str) -> int | None:
    pointer = work / f"shared/checkpoints/tester/exp/{trial}/.recover/current"
    return generation_step(os.readlink(pointer)) if pointer.is_symlink() else None


def _replicated_step(work: Path, trial: str, nodes: int) -> int | None:
    """The test's own oracle, read off the disks: the newest step whose generation (by any
    node's manifest) has every file, the manifest too, on ``COPIES`` + 1 nodes (all of them
    when fewer) at the manifest's size; None when none is."""
    stores = [work / f"{trial}-local/node{node}/checkpoints/tester/exp/{trial}/.recover" for node in range(nodes)]
    names = {folder.name for store in stores if store.is_dir() for folder in store.glob("gen-*") if folder.is_dir()}
    wanted = min(COPIES + 1, nodes)
    best = None
    for name in names:
        manifests = []
        for store in stores:
            try:
                manifests.append(read_manifest(store / name, RECOVER_MANIFEST))
            except ac.CheckpointError:
                continue
        if not manifests:
            continue
        needed: dict[str, int | None] = {RECOVER_MANIFEST: None}
        needed.update({entry: record["size"] for entry, record in manifests[0]["files"].items()})

        def holders(entry: str, size: int | None) -> int:
            paths = [store / name / entry for store in stores]
            return sum(path.is_file() and (size is None or path.stat().st_size == size) for path in paths)

        if all(holders(entry, size) >= wanted for entry, size in needed.items()):
            best = max(-1 if best is None else best, generation_step(name))
    return best


def scenario_peers(trials: int, rng: random.Random, work: Path, select: str | None = None) -> list:
    """Rows ``peers-kill-2``, ``peers-kill-4`` and ``peers-kill-4-on-2-nodes`` (those whose id
    contains ``select``)."""
    from torture import Row

    rows = []
    for world, per_node in ((2, 1), (4, 1), (4, 2)):
        nodes = world // per_node
        row = Row(f"peers-kill-{world}" + (f"-on-{nodes}-nodes" if per_node > 1 else ""))
        if select is not None and select not in row.scenario:
            continue
        from_nodes = from_shared = lost_tiers = 0
        for index in range(trials):
            trial = f"peers{world}x{per_node}-{index}"
            processes = start_processes(peer_job, world, str(work), trial, per_node)
            try:
                deadline = time.monotonic() + 120  # from the first generation whose copies are complete on
                while _replicated_step(work, trial, nodes) is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 3.0))
                for process in processes:
                    os.kill(process.pid, signal.SIGKILL)
            finally:
                for process in processes:
                    process.join(30)
            bound = _replicated_step(work, trial, nodes)  # no resume may be older, whichever tier is lost
            gone = rng.sample(range(nodes), rng.randint(0, COPIES))
            for node in gone:
                shutil.rmtree(work / f"{trial}-local/node{node}", ignore_errors=True)
            lost_tiers += len(gone)
            shared = _shared_step(work, trial)
            report = str(work / f"{trial}-rank")
            run_distributed(resume_peers, world, str(work), trial, per_node, report)
            found = [json.loads(Path(f"{report}{rank}.json").read_text()) for rank in range(world)]
            steps = {entry["step"] for entry in found}
            if None in steps or len(steps) != 1:
                row.record("lost", "; ".join(entry["why"] for entry in found if entry["why"]) or str(steps))
            elif steps.pop() < max(-1 if shared is None else shared, -1 if bound is None else bound):
                row.record(
                    "lost",
                    f"resumed {found[0]['step']}; the shared folder holds {shared}, copies were complete of {bound}",
                )
            elif not all(entry["exact"] for entry in found):
                row.record("wrong", f"weights do not all equal step {found[0]['step']}")
            else:
                row.record("resumed_correctly")
                from_nodes += shared is None or found[0]["step"] > shared
                from_shared += shared is not None and found[0]["step"] == shared
        row.notes.append(
            f"{lost_tiers} local tiers deleted in all; {from_nodes} resumes from the nodes (local tiers and "
            f"copies, newer than the shared folder), {from_shared} from the shared folder's newest"
        )
        rows.append(row)
    return rows
