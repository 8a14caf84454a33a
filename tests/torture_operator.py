"""`make torture`, second round: what an unlucky operator or an attacker does to a live trial.

- **Ctrl-C during dumps**: a job dumping after every step gets a real SIGINT at a random moment
  after its first commit. It must stop (KeyboardInterrupt reaches it: never retried, never
  converted) and the trial must load a whole checkpoint, as after a kill.
- **Lost commit record**: ``.recover/current`` deleted (a copy that dropped symlinks). Loading
  must refuse, nothing may be deleted, and ``areal-ckpt recover-pointer`` must restore the
  same step.
- **Store that is not a folder**, **planted lock link**: refused, the link's target untouched.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from distributed import start_processes
from recover_fixtures import SPEC, make_setup, recover_config, step_info

import areal_ckpt as ac
from areal_ckpt.cli.main import main as cli_main
from areal_ckpt.lock import LOCK_NAME

TRIAL = Path("checkpoints/tester/exp/trial")


def interrupt_job(rank: int, world: int, root: str) -> None:
    """Step s sets every weight to s and dumps synchronously, forever; Ctrl-C ends it."""
    import torch

    signal.signal(signal.SIGINT, signal.default_int_handler)  # forked workers inherit SIG_IGN
    setup = make_setup(hidden_size=192, intermediate_size=384, num_hidden_layers=3)
    handler = ac.RecoverHandler(recover_config(Path(root), write_retries=3), SPEC)
    for step in range(10**6):
        with torch.no_grad():
            for parameter in setup.model.parameters():
                parameter.fill_(float(step))
        handler.dump(setup.engine, step_info(step), force=True)


def scenario_ctrl_c(trials: int, rng: random.Random, work: Path, check, bound: float = 60.0):
    """``check(root, trial)`` is torture's loader check: ("resumed_correctly" | "lost" | "wrong", note)."""
    from torture import Row

    row = Row("Ctrl-C during sync dumps")
    for index in range(trials):
        root = work / f"ctrl-c-{index}"
        (job,) = start_processes(interrupt_job, 1, str(root))
        deadline = time.monotonic() + 120
        while not (root / TRIAL / ".recover/current").is_symlink() and job.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(job.pid, signal.SIGINT)
        job.join(bound)
        if job.is_alive():  # the interrupt was swallowed and the loop went on
            job.kill()
            job.join()
            row.record("lost", f"trial {index}: still running {bound:.0f} s after Ctrl-C")
            continue
        row.record(*check(root, "trial"))
    return row


def scenario_operator(work: Path, check):
    """Lost commit record, store that is not a folder, planted lock link; one trial each."""
    from torture import Row

    row = Row("operator faults")

    def dumped(name: str, steps: int = 2) -> Path:
        import torch

        root = work / f"operator-{name}"
        setup = make_setup()
        handler = ac.RecoverHandler(recover_config(root), SPEC)
        for step in range(steps):
            with torch.no_grad():
                for parameter in setup.model.parameters():
                    parameter.fill_(float(step))
            handler.dump(setup.engine, step_info(step), force=True)
        handler.close()
        return root

    root = dumped("lost-pointer")
    trial = root / TRIAL
    generations = sorted(p.name for p in (trial / ".recover").glob("gen-*"))
    (trial / ".recover/current").unlink()
    try:
        ac.RecoverHandler(recover_config(root), SPEC).load(make_setup(seed=1).engine)
        row.record("wrong", "lost commit record: loaded (or started fresh)")
    except ac.CheckpointError:
        if sorted(p.name for p in (trial / ".recover").glob("gen-*")) != generations:
            row.record("lost", "lost commit record: a generation was deleted")
        elif cli_main(["recover-pointer", str(trial)]) != 0:
            row.record("lost", "recover-pointer failed")
        else:
            row.record(*check(root, "trial"))

    for kind in ("file", "dangling link"):
        root = work / f"operator-store-{kind.replace(' ', '-')}"
        store = root / TRIAL / ".recover"
        store.parent.mkdir(parents=True)
        target = work / f"unmounted-{kind.replace(' ', '-')}"
        store.write_text("x") if kind == "file" else store.symlink_to(target)
        try:
            started = ac.check_if_recover(recover_config(root))
            row.record("wrong", f".recover as a {kind}: taken for {'a checkpoint' if started else 'a fresh trial'}")
        except ac.CheckpointError:
            row.record("wrong" if target.exists() else "resumed_correctly", f".recover as a {kind}")

    root = dumped("lock-link", steps=1)
    victim = work / "victim.txt"
    victim.write_text("precious")
    lock = root / TRIAL / LOCK_NAME
    lock.unlink()
    lock.symlink_to(victim)
    try:
        ac.RecoverHandler(recover_config(root), SPEC)
        row.record("wrong", "planted lock link: accepted")
    except ac.CheckpointError:
        row.record("resumed_correctly" if victim.read_text() == "precious" else "wrong", "planted lock link")
    return row
