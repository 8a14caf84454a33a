"""Hostile conditions, as numbers: `make torture` (full) or the short versions in the suite.

Each scenario runs trials against real processes and real files and returns a row
`scenario: trials, resumed-correctly, lost, wrong`; the goal for every row is lost = 0 and
wrong = 0. "lost" means a checkpoint that had been committed could not be loaded (or an error
was not reported); "wrong" means something loaded that should not have (a mix of steps, a
damaged file, a second job).

    python tests/torture.py --trials 200      # what `make torture` runs
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from distributed import start_processes  # noqa: E402
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step  # noqa: E402
from torture_objects import scenario_objects  # noqa: E402
from torture_operator import scenario_ctrl_c, scenario_operator  # noqa: E402
from torture_peers import scenario_peers  # noqa: E402
from torture_power import scenario_power_loss  # noqa: E402
from torture_preemption import scenario_preemption  # noqa: E402
from torture_rollout import scenario_rollout  # noqa: E402

import areal_ckpt as ac  # noqa: E402
from areal_ckpt.tools.inspection import verify  # noqa: E402

BIG = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3)  # ~2 MB of weights: dumps take a while


@dataclass
class Row:
    scenario: str
    trials: int = 0
    resumed_correctly: int = 0
    lost: int = 0
    wrong: int = 0
    notes: list[str] = field(default_factory=list)

    def record(self, outcome: str, note: str = "") -> None:
        self.trials += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        if note and outcome != "resumed_correctly" and len(self.notes) < 5:
            self.notes.append(note)

    def line(self) -> str:
        return f"{self.scenario}: {self.trials} trials, {self.resumed_correctly} resumed-correctly, {self.lost} lost, {self.wrong} wrong"


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)


def _every_weight_equals(model: torch.nn.Module, value: float) -> bool:
    return all(bool((p == value).all()) for p in model.parameters())


# -- 1 / 2: kills during dump and export ------------------------------------------------------


def dump_job(rank: int, world: int, root: str, trial: str, kind: str, mode: str) -> None:
    """Step s sets every weight to s, then dumps (recover) or exports (saver), forever."""
    setup = make_setup(**BIG)
    if kind == "recover":
        config = recover_config(Path(root), write_retries=0, mode="on" if mode == "sync" else mode)
        handler = ac.RecoverHandler(config.model_copy(update={"trial_name": trial}), SPEC)
    else:
        handler = ac.Saver(
            ac.SaverConfig(
                experiment_name="exp", trial_name=trial, fileroot=root, user="tester", max_shard_size="1MB", mode=mode
            ),
            SPEC,
        )
    for step in range(10**6):
        _fill(setup.model, float(step))
        if kind == "recover":
            handler.dump(setup.engine, step_info(step), force=True)
        else:
            handler.save(setup.engine, 0, step, step, force=True)


def _committed_once(trial_dir: Path, kind: str) -> bool:
    if kind == "recover":
        return (trial_dir / ".recover/current").is_symlink()
    model_root = trial_dir / "default"
    return model_root.is_dir() and any(p.name.startswith("epoch") for p in model_root.iterdir())


def _kill_at_random(
    root: Path, trial: str, kind: str, world: int, rng: random.Random, victims: list[int], mode: str = "sync"
) -> list:
    trial_dir = root / "checkpoints/tester/exp" / trial
    processes = start_processes(dump_job, world, str(root), trial, kind, mode)
    deadline = time.monotonic() + 120
    while not _committed_once(trial_dir, kind):
        if time.monotonic() > deadline or any(not p.is_alive() for p in processes):
            break
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.4))
    for victim in victims:
        os.kill(processes[victim].pid, signal.SIGKILL)
    return processes


def _check_recover(root: Path, trial: str, model: dict | None = None) -> tuple[str, str]:
    trial_dir = root / "checkpoints/tester/exp" / trial
    problems = verify(trial_dir)
    if problems:
        return "lost", "; ".join(problems[:2])
    setup = make_setup(seed=1, **(BIG if model is None else model))
    config = recover_config(root).model_copy(update={"trial_name": trial})
    handler = ac.RecoverHandler(config, SPEC)
    try:
        info = handler.load(setup.engine, drop_rank_state=True)
    except ac.CheckpointError as error:
        return "lost", str(error)
    finally:
        handler.close()
    if info is None:
        return "lost", "no checkpoint after a commit"
    if not _every_weight_equals(setup.model, float(info.last_step_info.global_step)):
        return "wrong", f"weights do not belong to step {info.last_step_info.global_step}"
    return "resumed_correctly", ""


def _check_exports(root: Path, trial: str) -> tuple[str, str]:
    model_root = root / "checkpoints/tester/exp" / trial / "default"
    ac.Saver(
        ac.SaverConfig(experiment_name="exp", trial_name=trial, fileroot=str(root), user="tester"), SPEC
    ).finalize()
    leftovers = [p.name for p in model_root.iterdir() if p.name.startswith(".")]
    if leftovers:
        return "wrong", f"debris after restart: {leftovers}"
    from helpers import read_export_tensors

    for export in model_root.iterdir():
        problems = verify(export)
        if problems:
            return "lost", "; ".join(problems[:2])
        step = float(export.name.rsplit("globalstep", 1)[1])
        if not all(bool((t == step).all()) for t in read_export_tensors(export).values()):
            return "wrong", f"{export.name}: weights of another step"
    return "resumed_correctly", ""


def _lock_released(trial_dir: Path, bound: float = 30.0) -> bool:
    """Wait until nothing holds the trial's lock: a killed job's background writers die with it
    (the kernel kills them when their parent dies), as a launcher restarting the job would."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            fd = os.open(trial_dir / ".areal_ckpt.lock", os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.01)
        finally:
            os.close(fd)
    return False


def scenario_kill_during_save(
    trials: int, world: int, kind: str, rng: random.Random, work: Path, mode: str = "sync"
) -> Row:
    row = Row(f"kill during {'dump' if kind == 'recover' else 'save'}, {world} rank(s), {mode}")
    for index in range(trials):
        trial = f"{kind}-{world}-{mode}-{index}"
        processes = _kill_at_random(work, trial, kind, world, rng, victims=list(range(world)), mode=mode)
        for process in processes:
            process.join()
        if not _lock_released(work / "checkpoints/tester/exp" / trial):
            row.record("lost", "a background writer outlived its killed job for 30 s")
            continue
        check = _check_recover if kind == "recover" else _check_exports
        row.record(*check(work, trial))
    return row


def scenario_kill_one_rank(trials: int, rng: random.Random, work: Path, bound: float = 60.0) -> Row:
    row = Row("kill one of 2 ranks mid-dump")
    for index in range(trials):
        trial = f"one-rank-{index}"
        victim = rng.randrange(2)
        processes = _kill_at_random(work, trial, "recover", 2, rng, victims=[victim])
        survivor = processes[1 - victim]
        survivor.join(bound)
        if survivor.is_alive():
            survivor.kill()
            survivor.join()
            row.record("lost", f"survivor rank {1 - victim} still running after {bound:.0f} s")
            continue
        processes[victim].join()
        if survivor.exitcode == 0:
            row.record("wrong", "survivor exited 0 after its peer died")
            continue
        row.record(*_check_recover(work, trial))
    return row


# -- 3: disk full ------------------------------------------------------------------------------


def disk_full_job(rank: int, world: int, root: str, report: str) -> None:
    setup = make_setup()
    train_step(setup, 0)  # AdamW now has state: a dump holds model + moments, about 1.0 MiB
    config = recover_config(Path(root), write_retries=2)
    handler = ac.RecoverHandler(config, SPEC)
    _fill(setup.model, 1.0)
    handler.dump(setup.engine, step_info(1), force=True)
    _fill(setup.model, 2.0)
    try:
        handler.dump(setup.engine, step_info(2), force=True)
        outcome = "no error"
    except ac.CheckpointError as error:
        outcome = str(error)
    Path(report).write_text(outcome)


def scenario_disk_full(trials: int, work: Path) -> Row:
    row = Row("disk full mid-dump (tmpfs)")
    for index in range(trials):
        mount = work / f"disk-full-{index}"
        mount.mkdir()
        # one dump of the small model takes about 1.0 MiB: room for one generation, not two
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1600k", "tmpfs", str(mount)], capture_output=True
            ).returncode
            == 0
        )
        if not mounted:
            row.scenario = "disk full mid-dump (tmpfs unavailable: not run)"
            return row
        try:
            report = work / f"disk-full-{index}.txt"
            (process,) = start_processes(disk_full_job, 1, str(mount), str(report))
            process.join(300)
            outcome = report.read_text() if report.exists() else f"job died ({process.exitcode})"
            if "no space left on device" not in outcome.lower() or "previous checkpoint is intact" not in outcome:
                row.record("wrong", f"unexpected outcome: {outcome[:200]}")
                continue
            row.record(*_check_recover_named(mount, "trial", expect_step=1))
        finally:
            if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "--lazy", str(mount)], capture_output=True)
    return row


def _check_recover_named(root: Path, trial: str, expect_step: int) -> tuple[str, str]:
    outcome, note = _check_recover(root, trial, model={})
    store = root / "checkpoints/tester/exp" / trial / ".recover"
    leftovers = sorted(p.name for p in store.iterdir())
    if outcome == "resumed_correctly" and len(leftovers) != 2:
        return "wrong", f"debris after restart: {leftovers}"
    current = (store / "current").readlink().name
    if outcome == "resumed_correctly" and not current.startswith(f"gen-{expect_step:08d}"):
        return "wrong", f"committed {current}, expected step {expect_step}"
    return outcome, note


# -- 4: corruption ------------------------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


def scenario_corruption(work: Path) -> Row:
    row = Row("corruption: flip / truncate / delete each file")
    pristine = work / "corruption-pristine"
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(pristine), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    generation = (pristine / "checkpoints/tester/exp/trial/.recover/current").resolve()
    files = sorted(p.relative_to(generation) for p in generation.rglob("*") if p.is_file())
    for index, relative in enumerate(files):
        for how in ("flip", "truncate", "delete"):
            if how == "truncate" and (generation / relative).stat().st_size < 2:
                continue
            copy = work / f"corruption-{index}-{how}"
            shutil.copytree(pristine, copy, symlinks=True)
            damaged = (copy / "checkpoints/tester/exp/trial/.recover/current").resolve() / relative
            _damage(damaged, how)
            problems = verify(copy / "checkpoints/tester/exp/trial")
            named = any(relative.name in problem for problem in problems)
            handler = ac.RecoverHandler(recover_config(copy), SPEC)
            try:
                handler.load(make_setup(seed=1).engine)
                loaded, message = True, ""
            except ac.CheckpointError as error:
                loaded, message = False, str(error)
            finally:
                handler.close()
            if loaded:
                row.record("wrong", f"{how} {relative}: loaded silently")
            elif not named or relative.name not in message:
                row.record("lost", f"{how} {relative}: detected but the file was not named ({message[:120]})")
            else:
                row.record("resumed_correctly")
    return row


# -- 5: hostile files ---------------------------------------------------------------------------


def scenario_hostile(work: Path) -> Row:
    row = Row("hostile files")
    marker = work / "code-ran"
    outside = work / "outside.json"
    outside.write_text('{"secret": 1}')

    def fresh(name: str) -> Path:
        root = work / f"hostile-{name}"
        setup = make_setup()
        ac.RecoverHandler(recover_config(root), SPEC).dump(setup.engine, step_info(0), force=True)
        return root

    def expect_refusal(name: str, root: Path) -> None:
        try:
            ac.RecoverHandler(recover_config(root), SPEC).load(make_setup(seed=1).engine)
            row.record("wrong", f"{name}: loaded")
        except ac.CheckpointError as error:
            row.record("wrong" if marker.exists() else "resumed_correctly", f"{name}: {error}")

    import pickle

    class RunsCode:
        def __reduce__(self):
            return (Path.touch, (marker,))

    for target in (
        "recover_info/rank0.json",
        "recover_info/step_info.json",
        "default/engine_state.json",
        "default/dcp_metadata.json",
    ):
        root = fresh(f"pickle-{target.replace('/', '-')}")
        (root / "checkpoints/tester/exp/trial/.recover/current").resolve().joinpath(target).write_bytes(
            pickle.dumps(RunsCode())
        )
        expect_refusal(f"pickle in {target}", root)
    root = fresh("symlink")
    target = (root / "checkpoints/tester/exp/trial/.recover/current").resolve() / "recover_info/rank0.json"
    target.unlink()
    target.symlink_to(outside)
    expect_refusal("symlink to outside", root)
    root = fresh("linked-folder")
    generation = (root / "checkpoints/tester/exp/trial/.recover/current").resolve()
    elsewhere = work / "elsewhere-model"
    shutil.move(generation / "default", elsewhere)
    (generation / "default").symlink_to(elsewhere)
    expect_refusal("model folder replaced by a link to outside", root)
    root = fresh("pointer")
    pointer = root / "checkpoints/tester/exp/trial/.recover/current"
    pointer.unlink()
    pointer.symlink_to("../../../../../../")
    expect_refusal("commit record pointing outside", root)
    for name in ("../escape", "a/b", ".hidden"):
        try:
            ac.SaverConfig(experiment_name=name, trial_name="t", fileroot=str(work))
            row.record("wrong", f"name {name!r} accepted")
        except ValueError:
            row.record("resumed_correctly")
    absurd = work / "absurd.safetensors"
    absurd.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    from areal_ckpt.tools.inspection import read_safetensors_header

    try:
        read_safetensors_header(absurd)
        row.record("wrong", "absurd safetensors header accepted")
    except ac.CheckpointError:
        row.record("resumed_correctly")
    return row


# -- 6: two jobs, one trial ---------------------------------------------------------------------


def holder_job(rank: int, world: int, root: str, ready: str) -> None:
    ac.RecoverHandler(recover_config(Path(root)), SPEC)
    Path(ready).touch()
    time.sleep(600)


def second_job(rank: int, world: int, root: str, report: str) -> None:
    try:
        ac.RecoverHandler(recover_config(Path(root)), SPEC)
        Path(report).write_text("accepted")
    except ac.CheckpointError as error:
        Path(report).write_text(f"refused: {error}")


def scenario_two_jobs(trials: int, work: Path) -> Row:
    row = Row("two jobs, one trial")
    for index in range(trials):
        root, ready = work / f"two-jobs-{index}", work / f"two-jobs-{index}.ready"
        (holder,) = start_processes(holder_job, 1, str(root), str(ready))
        while not ready.exists() and holder.is_alive():
            time.sleep(0.01)
        report = work / f"two-jobs-{index}.txt"
        (second,) = start_processes(second_job, 1, str(root), str(report))
        second.join()
        refused = report.read_text()
        os.kill(holder.pid, signal.SIGKILL)  # the holder crashes: its lock must die with it
        holder.join()
        (third,) = start_processes(second_job, 1, str(root), str(report))
        third.join()
        after_crash = report.read_text()
        if not refused.startswith("refused") or f"'pid': {holder.pid}" not in refused.replace('"', "'"):
            row.record("wrong", f"second job: {refused[:160]}")
        elif after_crash != "accepted":
            row.record("lost", f"after the holder died: {after_crash[:160]}")
        else:
            row.record("resumed_correctly")
    return row


# -- 7: bad configuration -----------------------------------------------------------------------


def scenario_bad_config(work: Path) -> Row:
    from test_config import BAD_CONFIGS

    row = Row("bad configuration")
    for label, text, fragments in BAD_CONFIGS:
        path = work / "bad.yaml"
        path.write_text(text)
        try:
            ac.load_config(path)
            row.record("wrong", f"{label}: accepted")
        except ac.ConfigError as error:
            ok = all(fragment in str(error) for fragment in fragments)
            row.record("resumed_correctly" if ok else "lost", f"{label}: {error}")
    return row


def run_all(trials: int, seed: int = 0, select: str | None = None) -> list[Row]:
    """Every scenario (or those whose id contains ``select``) with ``trials`` kills per kill
    configuration."""
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="areal-ckpt-torture-"))
    try:
        scenarios: list[tuple[str, Callable[[], Row]]] = [
            (
                f"kill-{kind}-{world}-{mode}",
                functools.partial(scenario_kill_during_save, trials, world, kind, rng, work, mode),
            )
            for mode in ("sync", "async")
            for kind in ("recover", "saver")
            for world in (1, 2)
        ]
        scenarios += [
            ("kill-one-rank", lambda: scenario_kill_one_rank(max(2, trials // 10), rng, work)),
            ("disk-full", lambda: scenario_disk_full(max(1, trials // 50), work)),
            ("corruption", lambda: scenario_corruption(work)),
            ("hostile", lambda: scenario_hostile(work)),
            ("two-jobs", lambda: scenario_two_jobs(max(1, trials // 50), work)),
            ("bad-config", lambda: scenario_bad_config(work)),
            ("ctrl-c", lambda: scenario_ctrl_c(max(2, trials // 10), rng, work, _check_recover)),
            ("operator", lambda: scenario_operator(work, functools.partial(_check_recover, model={}))),
        ]
        rows = [run() for name, run in scenarios if select is None or select in name]
        if select is None or select in "power-loss":
            rows += scenario_power_loss(trials, rng, work)
        rows += scenario_objects(max(2, trials // 10), rng, work, select)
        rows += scenario_peers(max(2, trials // 10), rng, work, select)
        rows += scenario_preemption(max(2, trials // 10), rng, work, select)
        rows += scenario_rollout(max(2, trials // 10), rng, work, select)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200, help="kills per kill configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the results table (Markdown) here")
    parser.add_argument(
        "--select",
        default=None,
        help="run only scenarios whose id contains this (ids: kill-{recover,saver}-{1,2}-{sync,async}, "
        "kill-one-rank, disk-full, corruption, hostile, two-jobs, bad-config, ctrl-c, operator, power-loss, s3-kill, gs-kill, az-kill, peers-kill, preempt-*, rollout-kill-{1rank,2ranks})",
    )
    args = parser.parse_args(argv)
    started = time.time()
    rows = run_all(args.trials, args.seed, args.select)
    heading = (
        f"torture run: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, "
        f"{args.trials} trials per kill configuration, seed {args.seed}, {time.time() - started:.0f} s"
    )
    print(f"\n{heading}")
    for row in rows:
        print(row.line())
        for note in row.notes:
            print(f"    {note}")
    if args.out:
        table = ["| scenario | trials | resumed correctly | lost | wrong |", "| --- | --- | --- | --- | --- |"]
        table += [f"| {r.scenario} | {r.trials} | {r.resumed_correctly} | {r.lost} | {r.wrong} |" for r in rows]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(heading + "\n\n" + "\n".join(table) + "\n")
    return 0 if all(row.lost == 0 and row.wrong == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
