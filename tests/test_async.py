"""Asynchronous saving (mode: async): shared-memory staging, background writer processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from helpers import export_names, read_export_tensors, saver_config
from recover_fixtures import SPEC, committed_generation, make_setup, recover_config, step_info, train_step
from recovery_runs import assert_same_run, run_job
from test_saver_distributed import SHARD, trained_model

import areal_ckpt as ac
from areal_ckpt.jobs.lifecycle import resolve_async
from areal_ckpt.jobs.shm_arena import StagingArena, arena_layout_of, view

pytestmark = pytest.mark.dist


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)


def test_auto_is_async_only_for_a_model_on_an_accelerator():
    assert resolve_async("async", on_accelerator=False) and not resolve_async("sync", on_accelerator=True)
    for mode in ("auto", "on"):
        assert resolve_async(mode, on_accelerator=True) and not resolve_async(mode, on_accelerator=False)
    assert ac.RecoverConfig(experiment_name="e", trial_name="t", fileroot="/r", mode="async").mode == "async"


def test_staging_arena_copies_reuses_its_memory_and_frees_it():
    arena = StagingArena()
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).bfloat16()}
    layout = arena_layout_of(tensors)
    arena.stage(layout, tensors.items())
    buffer = arena.buffer
    assert buffer.is_shared() and arena.capacity >= layout.nbytes
    for name, tensor in tensors.items():
        assert torch.equal(view(buffer, layout.tensors[name]), tensor)
    tensors["a"].add_(1)  # a staged copy does not follow the live tensor
    assert not torch.equal(view(buffer, layout.tensors["a"]), tensors["a"])
    arena.stage(layout, tensors.items())
    assert arena.buffer is buffer and torch.equal(view(buffer, layout.tensors["a"]), tensors["a"])
    swapped = {"b": tensors["b"], "a": tensors["a"].neg(), "c": tensors["c"]}  # same room, other places
    arena.stage(arena_layout_of(swapped), swapped.items())
    assert arena.buffer is buffer
    for name, tensor in swapped.items():
        assert torch.equal(view(buffer, arena_layout_of(swapped).tensors[name]), tensor), name
    bigger = {**tensors, "d": torch.randn(1000)}
    arena.stage(arena_layout_of(bigger), bigger.items())
    assert arena.buffer is not buffer and arena.capacity >= arena_layout_of(bigger).nbytes
    for name, tensor in bigger.items():
        assert torch.equal(view(arena.buffer, arena_layout_of(bigger).tensors[name]), tensor), name
    arena.release()
    assert arena.capacity == 0


def test_async_exports_are_the_sync_exports_and_keep_retention(tmp_path, make_model):
    sync_root, async_root = tmp_path / "sync", tmp_path / "async"
    model = make_model(1)
    engine = ac.TorchEngine(model)
    fields = dict(freq_steps=1, keep_last=2, max_shard_size="100KB")
    sync_saver = ac.Saver(saver_config(sync_root, mode="sync", **fields), SPEC)
    async_saver = ac.Saver(saver_config(async_root, mode="async", **fields), SPEC)
    for step in range(4):
        _fill(model, float(step))
        sync_path = Path(sync_saver.save(engine, 0, step, step))
        async_path = Path(async_saver.save(engine, 0, step, step))
        assert set(async_saver.last_metrics) >= {"time/saving", "bytes"}
        _fill(model, -1.0)  # the training step after save: the background write must not see it
    async_saver.finalize()
    sync_saver.finalize()
    assert (
        export_names(async_path.parent)
        == export_names(sync_path.parent)
        == ["epoch0epochstep2globalstep2", "epoch0epochstep3globalstep3"]
    )
    assert set(async_saver.last_metrics) == {"time/saving", "time/background", "bytes", "gbps"}
    files = sorted(p.name for p in sync_path.iterdir())
    assert files == sorted(p.name for p in async_path.iterdir()) and "model.safetensors.index.json" in files
    for name in files:
        if name.endswith(".safetensors") or name.endswith(".json") and name != "areal_ckpt_manifest.json":
            assert (async_path / name).read_bytes() == (sync_path / name).read_bytes(), name
    assert all(bool((t == 3.0).all()) for t in read_export_tensors(async_path).values())
    assert not [p for p in async_path.parent.iterdir() if p.name.startswith(".")]  # no staging left


TRAINING_SCRIPT = """
import sys
from pathlib import Path

MARKER = Path(sys.argv[1])
with MARKER.open("a") as marker:  # top-level code: runs once per import of this script
    marker.write(__name__ + "\\n")

if __name__ == "__main__":
    import areal_ckpt as ac
    from areal_ckpt.demo.tiny import build_model

    saver = ac.Saver(ac.SaverConfig(experiment_name="exp", trial_name="trial", fileroot=sys.argv[2],
                                    user="tester", mode="async"),
                     ac.FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=2))
    saver.save(ac.TorchEngine(build_model(64)), 0, 1, 1, force=True)
    saver.finalize()
"""


def test_the_background_writer_does_not_run_the_training_script_again(tmp_path):
    script, marker = tmp_path / "train.py", tmp_path / "imports.txt"
    script.write_text(TRAINING_SCRIPT)
    subprocess.run([sys.executable, str(script), str(marker), str(tmp_path / "root")], check=True, timeout=300)
    exports = list((tmp_path / "root/checkpoints/tester/exp/trial/default").iterdir())
    assert [p.name for p in exports] == ["epoch0epochstep1globalstep1"]
    assert marker.read_text().splitlines() == ["__main__"]  # a spawned child would add "__mp_main__"


def test_the_background_writer_yields_the_cores_to_training(tmp_path, make_model):
    model = make_model()
    saver = ac.Saver(saver_config(tmp_path, mode="async"), SPEC)
    saver.save(ac.TorchEngine(model), 0, 1, 1, force=True)
    saver.wait()  # the writer has started and run a job
    writers = [p for p in multiprocessing.active_children() if p.name.startswith("areal_ckpt")]
    assert len(writers) == 1
    assert os.getpriority(os.PRIO_PROCESS, writers[0].pid) == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)
    saver.finalize()


def async_fsdp2_export_worker(rank: int, world_size: int, fileroot: str) -> None:
    config = ac.SaverConfig(
        experiment_name="exp",
        trial_name="fsdp2-async",
        fileroot=fileroot,
        user="tester",
        max_shard_size=SHARD,
        mode="async",
    )
    saver = ac.Saver(config, SPEC)
    model = trained_model("fsdp2")
    saver.save(ac.TorchEngine(model), 0, 1, 1, force=True)
    _fill(model, 0.0)  # training goes on while the writers write
    saver.finalize()


def test_two_rank_fsdp2_async_export_equals_single_process_export(fileroot):
    run_distributed(async_fsdp2_export_worker, 2, str(fileroot))
    multi = fileroot / "checkpoints/tester/exp/fsdp2-async/default/epoch0epochstep1globalstep1"
    saver = ac.Saver(saver_config(fileroot, max_shard_size=SHARD, mode="sync"), SPEC)
    single = Path(saver.save(ac.TorchEngine(trained_model("none")), 0, 1, 1, force=True))
    shards = sorted(p.name for p in single.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards == sorted(p.name for p in multi.glob("model-*.safetensors"))
    for name in shards:
        assert (multi / name).read_bytes() == (single / name).read_bytes(), name


def test_async_dumps_resume_bit_exactly_after_kills(reference_run, tmp_path):
    # dumps after steps 1, 3, 5...; a kill right after dump() returns (step 5) lands while the
    # background write is in flight, so the resume may start from step 3 or from step 5
    root, out = tmp_path / "root", tmp_path / "out"
    for kill_at in (5, 8):
        assert run_job(root, out, extra=["--mode", "async", "--kill-at", str(kill_at)]) == [-9]
    run_job(root, out, extra=["--mode", "async"])
    assert_same_run(reference_run, out, world_size=1)


def test_async_fsdp2_dumps_resume_bit_exactly(reference_run_fsdp2, tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    assert run_job(root, out, world_size=2, wrap="fsdp2", extra=["--mode", "async", "--kill-at", "4"]) == [-9, -9]
    run_job(root, out, world_size=2, wrap="fsdp2", extra=["--mode", "async"])
    assert_same_run(reference_run_fsdp2, out, world_size=2)


def test_a_one_rank_fsdp2_job_dumps_async_and_resumes_bit_exactly(tmp_path):
    # torchrun --nproc-per-node 1 with FSDP2: DTensors on a one-rank group whose store holds
    # MASTER_PORT; the background writer must not rendezvous there to rebuild their mesh
    reference, root, out = tmp_path / "reference", tmp_path / "root", tmp_path / "out"
    run_job(reference, tmp_path / "reference-out", wrap="fsdp2", group=True)
    assert run_job(root, out, wrap="fsdp2", group=True, extra=["--mode", "async", "--kill-at", "4"]) == [-9]
    run_job(root, out, wrap="fsdp2", group=True, extra=["--mode", "async"])
    assert_same_run(tmp_path / "reference-out", out, world_size=1)


def test_an_async_dump_writes_the_files_a_sync_dump_writes(tmp_path, tokenizer):
    setup = make_setup()
    train_step(setup, 0)
    folders = {}
    for mode in ("sync", "async"):
        handler = ac.RecoverHandler(recover_config(tmp_path / mode, mode=mode), SPEC)
        handler.dump(setup.engine, step_info(1), tokenizer=tokenizer, client_state={"kl": 0.5}, force=True)
        handler.close()
        folders[mode] = committed_generation(tmp_path / mode)
    files = {mode: sorted(str(p.relative_to(f)) for p in f.rglob("*") if p.is_file()) for mode, f in folders.items()}
    assert files["async"] == files["sync"]
    assert "default/hf/tokenizer.json" in files["async"] and "default/hf/config.json" in files["async"]
    differ = ("areal_ckpt_manifest.json", "checkpoint_info.json")  # creation and trigger times
    for relative in files["sync"]:
        if relative.endswith(".json") and not relative.endswith(differ):
            assert (folders["async"] / relative).read_bytes() == (folders["sync"] / relative).read_bytes(), relative
    assert b'"kl": 0.5' in (folders["async"] / "recover_info/rank0.json").read_bytes()


def test_a_dead_writer_is_reported_and_the_next_dump_starts_a_new_one(fileroot):
    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, mode="async"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.wait()
    good = committed_generation(fileroot)
    (writer,) = multiprocessing.active_children()
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    train_step(setup, 1)
    with pytest.raises(ac.CheckpointError, match=r"background writer process \d+ died"):
        handler.dump(setup.engine, step_info(1), force=True)
        handler.wait()
    assert committed_generation(fileroot) == good
    train_step(setup, 2)
    path = handler.dump(setup.engine, step_info(2), force=True)
    handler.close()
    assert committed_generation(fileroot) == Path(path)
    assert sorted(p.name for p in committed_generation(fileroot).parent.iterdir()) == ["current", Path(path).name]
    assert set(handler.last_metrics) == {"time/saving", "time/background", "bytes", "gbps"}
    resumed = make_setup(seed=1)
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(resumed.engine)
    assert info.last_step_info.global_step == 2
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_a_writer_killed_right_after_its_commit_counts_as_committed_and_dumps_go_on(fileroot, monkeypatch, caplog):
    """The job committed, then its writer died before reporting: the handler learns what its
    writer committed (it is the loaded generation from now on), later dumps start a new writer
    and commit, and a restart resumes from the newest."""
    from writer_faults import DiesAfterCommitting

    from areal_ckpt.jobs.background import BackgroundWriter

    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(fileroot, mode="async"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.wait()
    submit = BackgroundWriter.submit
    monkeypatch.setattr(BackgroundWriter, "submit", lambda writer, job: submit(writer, DiesAfterCommitting(job)))
    train_step(setup, 1)
    path = handler.dump(setup.engine, step_info(1), force=True)
    handler.wait()  # no error: the dump is committed
    assert committed_generation(fileroot) == Path(path)
    assert f"recovery checkpoint {path} committed, although a background writer failed after its commit" in caplog.text
    monkeypatch.undo()
    train_step(setup, 2)
    path = handler.dump(setup.engine, step_info(2), force=True)
    handler.close()
    assert committed_generation(fileroot) == Path(path)
    assert sorted(p.name for p in committed_generation(fileroot).parent.iterdir()) == ["current", Path(path).name]
    resumed = make_setup(seed=1)
    assert ac.RecoverHandler(recover_config(fileroot), SPEC).load(resumed.engine).last_step_info.global_step == 2
    for name, tensor in setup.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_a_loop_held_up_by_a_background_save_says_so_and_goes_on_waiting(fileroot, monkeypatch, caplog):
    """The next dump (or close) waits for the save in flight; while that save is held up (here
    until the test lets it go, which it does only once the warning is logged) the wait is
    logged as a warning naming the writer, and the save then commits as usual."""
    import logging

    from writer_faults import WaitsForRelease

    from areal_ckpt.jobs import background

    release = fileroot / "release"
    submit = background.BackgroundWriter.submit
    monkeypatch.setattr(
        background.BackgroundWriter, "submit", lambda writer, job: submit(writer, WaitsForRelease(job, str(release)))
    )
    monkeypatch.setattr(background, "_BLOCKED_WARNING_SECONDS", 0.2)

    class ReleaseOnWarning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "has waited" in record.getMessage():
                release.touch()

    releaser = ReleaseOnWarning(logging.WARNING)
    logging.getLogger("areal_ckpt.jobs.background").addHandler(releaser)
    try:
        setup = make_setup()
        handler = ac.RecoverHandler(recover_config(fileroot, mode="async"), SPEC)
        path = handler.dump(setup.engine, step_info(0), force=True)
        with pytest.raises(FileNotFoundError):  # held up: nothing committed yet
            committed_generation(fileroot)
        handler.wait()
    finally:
        logging.getLogger("areal_ckpt.jobs.background").removeHandler(releaser)
    waits = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert waits and waits[0].startswith("recover: the training loop has waited")
    assert "still running" in waits[0] and "logs each retry" in waits[0]
    assert committed_generation(fileroot) == Path(path)
    handler.close()


def writers_meeting_worker(rank: int, world_size: int, root: str, report: str) -> None:
    from torch.distributed.distributed_c10d import _get_default_store

    setup = make_setup()
    handler = ac.RecoverHandler(recover_config(Path(root), mode="async"), SPEC)
    handler.dump(setup.engine, step_info(0), force=True)
    handler.wait()
    handler.close()
    store = _get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store  # the job's TCPStore itself, all its keys
    keys = [key for key in store.list_keys() if key.startswith("areal_ckpt/writers/recover/")]
    torch.distributed.barrier()  # rank 0 serves the store: it stays until every rank has listed
    Path(f"{report}.{rank}").write_text(json.dumps(keys))


@pytest.mark.dist
def test_the_writers_meet_on_the_jobs_own_store_and_open_no_store_of_their_own(tmp_path):
    """Two ranks' writers form their group under a fresh prefix in the training job's TCPStore,
    so no writer serves a store of its own (an unauthenticated port on every interface)."""
    run_distributed(writers_meeting_worker, 2, str(tmp_path / "root"), str(tmp_path / "keys"))
    seen = [json.loads(Path(f"{tmp_path / 'keys'}.{rank}").read_text()) for rank in range(2)]
    assert seen[0] and seen[0] == seen[1]
    assert len({key.split("/")[3] for key in seen[0]}) == 1  # one start, one prefix


def staging_agreement_worker(rank: int, world_size: int, report: str) -> None:
    from areal_ckpt.jobs.shm_arena import arena_layout_of_specs, shared_memory_free

    # rank 1 asks for more shared memory than /dev/shm has: a real refusal, before any copy
    too_big = (shared_memory_free() or 0) + 2**30
    size = 1024 if rank == 0 else too_big
    layout = arena_layout_of_specs([("t", torch.uint8, (size,))])
    try:
        StagingArena().stage(layout, iter([]))
        outcome = "staged"
    except ac.CheckpointError as error:
        outcome = str(error)
    Path(f"{report}.{rank}").write_text(outcome)


def test_a_rank_that_cannot_stage_stops_every_rank_before_any_copy(tmp_path):
    run_distributed(staging_agreement_worker, 2, str(tmp_path / "report"))
    reports = [(tmp_path / f"report.{rank}").read_text() for rank in range(2)]
    assert reports[0] == reports[1]  # the same error on every rank, naming the rank and its cause
    assert "rank 1: /dev/shm: staging an asynchronous save needs" in reports[0]


def _private_bytes() -> int:
    """This process's private anonymous memory (RssAnon): what a copy of tensors held here adds,
    unlike the shared-memory staging copy (RssShmem)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))) * 1024


def test_an_async_dump_holds_no_second_copy_of_the_state_once_staged(tmp_path):
    """AReaL's #1615: once an asynchronous save is staged, the training process holds no copy of
    the tensors besides the staging memory the writer reads (measured while the writer writes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(16)))  # 64 MiB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    state = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    engine = ac.TorchEngine(model, optimizer=optimizer)
    handler = ac.RecoverHandler(recover_config(tmp_path, mode="async"), SPEC)
    try:
        handler.dump(engine, step_info(0), force=True)  # the staging memory is made once
        handler.wait()
        before = _private_bytes()
        handler.dump(engine, step_info(1), force=True)
        during = _private_bytes()  # dump returned once staged; the writer may still be writing
        handler.wait()
    finally:
        handler.close()
    assert during - before < state // 8, f"{(during - before) / 2**20:.0f} MiB more held than before the dump"
