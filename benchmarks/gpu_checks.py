"""The checks of `make gpu-check` (benchmarks/gpu_check.py runs them and reports): each runs
one path with tensors on ``device`` ("cuda", or "cpu" in a rehearsal) and returns its
:class:`Line`. Each writes only under the scratch folder it is given."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from common import model_of_size, state_tensors
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import areal_ckpt as ac

JOB = Path(__file__).resolve().parent.parent / "tests" / "recover_job.py"
SPEC = ac.FinetuneSpec(total_train_epochs=1, dataset_size=10**6, train_batch_size=1)
KILL_AT = 5  # the resume check's job is killed after this step's dump
FILL_SECONDS = 300  # the two-rank check is stopped after this long (NCCL may hang rather than refuse)
GB = 1e9


class Line:
    """One check's outcome: PASS / FAIL / NOT RUN, its name and what it measured or why."""

    def __init__(self, verdict: str, name: str, detail: str) -> None:
        self.verdict, self.name, self.detail = verdict, name, detail

    def __str__(self) -> str:
        return f"{self.verdict:<7} {self.name}: {self.detail}"


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _step(step: int) -> ac.StepInfo:
    return ac.StepInfo(epoch=0, epoch_step=step, global_step=step, steps_per_epoch=10**6)


def _recover_config(root: Path, trial: str, mode: str, **extra: object) -> ac.RecoverConfig:
    return ac.RecoverConfig(
        experiment_name="gpu", trial_name=trial, fileroot=str(root), user="gpu", mode=mode, freq_steps=1, **extra
    )


def _trained(mib: int, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Qwen2-shaped model of ``mib`` MiB on ``device`` after one AdamW step (moments exist)."""
    model = model_of_size(mib, dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.arange(32, device=device).reshape(2, 16)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    return model, optimizer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def _same_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, other: tuple) -> list[str]:
    """Positions of the state tensors (weights, then optimizer state in order; this rank's
    shards) that differ bitwise."""
    mine, theirs = state_tensors(model, optimizer), state_tensors(*other)
    return [str(index) for index, (a, b) in enumerate(zip(mine, theirs)) if not torch.equal(_local(a), _local(b))]


def _perturbed(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """The same model and optimizer with every state tensor changed, so a load must restore it."""
    with torch.no_grad():
        for tensor in state_tensors(model, optimizer):
            tensor.add_(1)
    return model, optimizer


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_resume(device: str, work: Path, wrap: str = "none") -> Line:
    """Kill + resume of a real job against the same job run through: bitwise final state, losses.
    ``wrap="fsdp2"``: the model sharded by FSDP2 in a one-rank process group (NCCL on CUDA)."""
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    label = "resume" if wrap == "none" else f"resume {wrap} ({'NCCL' if device == 'cuda' else 'gloo'}, 1 rank)"

    def job(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(JOB), "--fileroot", str(work / name), "--out", str(work / f"out-{name}")]
        command += ["--device", device, "--mode", "async", "--freq-steps", "1", "--wrap", wrap, *extra]
        group = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        ranks = {**group, "MASTER_PORT": str(free_port())} if wrap != "none" else {}
        return subprocess.run(command, env={**env, **ranks}, capture_output=True, text=True, timeout=600)

    start = time.perf_counter()
    through = job("through")
    killed = job("resumed", "--kill-at", str(KILL_AT))
    resumed = job("resumed")
    seconds = time.perf_counter() - start
    for what, run, expected in (("run through", through, 0), ("killed", killed, -9), ("restarted", resumed, 0)):
        if run.returncode != expected:
            return Line("FAIL", label, f"the {what} job exited {run.returncode}: {run.stderr.strip()[-400:]}")
    from safetensors.torch import load_file

    want, got = (load_file(work / f"out-{name}" / "final-rank0.safetensors") for name in ("through", "resumed"))
    different = [name for name in want if name not in got or not torch.equal(want[name], got[name])]
    losses = {
        name: set((work / f"out-{name}" / "losses-rank0.jsonl").read_text().splitlines())
        for name in ("through", "resumed")
    }
    steps = len(losses["through"])
    if different or losses["through"] != losses["resumed"]:
        shown = different[:3] or ["losses"]
        return Line("FAIL", label, f"differs from the run through after a kill at step {KILL_AT}: {shown}")
    return Line(
        "PASS",
        label,
        f"killed after step {KILL_AT}'s async dump, restarted: {len(want)} tensors bitwise equal to the run "
        f"through, {steps} losses equal ({device} dropout and kernels; 3 jobs in {seconds:.0f} s)",
    )


def check_async(device: str, mib: int, rounds: int, work: Path) -> Line:
    """Our async dump's blocking seconds against one device-to-host copy and dcp.async_save."""
    model, optimizer = _trained(mib, torch.float32, device)
    engine = ac.TorchEngine(model, optimizer=optimizer)
    handler = ac.RecoverHandler(_recover_config(work / "ours", "async", "async"), SPEC)
    pinned = device == "cuda"
    tensors = state_tensors(model, optimizer)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    options = StagingOptions() if pinned else StagingOptions(False, True, False, False)
    stagers = [DefaultStager(options)]
    saves = iter(range(1, 10**6))

    def copy() -> float:
        _sync(device)
        start = time.perf_counter()
        for target, tensor in zip(host, tensors):
            target.copy_(tensor, non_blocking=pinned)
        _sync(device)
        return time.perf_counter() - start

    def ours() -> float:
        _sync(device)
        start = time.perf_counter()
        handler.dump(engine, _step(next(saves)), force=True)
        blocked = time.perf_counter() - start
        handler.wait()
        return blocked

    def theirs() -> float:
        folder = work / f"torch-{next(saves)}"
        model_state, optim_state = get_state_dict(model, optimizer)
        _sync(device)
        start = time.perf_counter()
        response = dcp.async_save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=str(folder),
            async_checkpointer_type=dcp.state_dict_saver.AsyncCheckpointerType.PROCESS,
            async_stager=stagers[-1],
        )
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()  # the state may change from here on
        blocked = time.perf_counter() - start
        getattr(response, "upload_completion", response).result()
        shutil.rmtree(folder, ignore_errors=True)
        if not stagers[-1]._state_dict_stager._deepcopy_dispatch:  # torch 2.11 closes it after each stage
            stagers.append(DefaultStager(options))  # then each save pins its memory anew, as torch's users' do
        return blocked

    try:
        for measure in (copy, ours, theirs):  # warm-up: writer processes started, memory registered
            measure()
        times: dict[str, list[float]] = {"copy": [], "ours": [], "theirs": []}
        for index in range(rounds):
            order = [("copy", copy), ("ours", ours), ("theirs", theirs)]
            for name, measure in order[index % 3 :] + order[: index % 3]:
                times[name].append(measure())
    finally:
        handler.close()
        stagers[-1].close()
    fresh = _perturbed(*_trained(mib, torch.float32, device))
    loader = ac.RecoverHandler(_recover_config(work / "ours", "async", "on"), SPEC)
    loader.load(ac.TorchEngine(fresh[0], optimizer=fresh[1]))
    loader.close()
    different = _same_state(model, optimizer, fresh)
    median = {name: statistics.median(values) for name, values in times.items()}
    size = sum(t.numel() * t.element_size() for t in tensors) / GB
    figures = (
        f"{size:.2f} GB fp32 + AdamW; blocks {median['ours']:.3f} s, {median['ours'] / median['copy']:.2f}x one "
        f"device-to-host copy ({median['copy']:.3f} s; target <= 1.5x), dcp.async_save with its pinned stager "
        f"({'reused' if len(stagers) == 1 else 'new each save: this torch closes it after staging'}) / "
        f"ours {median['theirs'] / median['ours']:.2f}x ({median['theirs']:.3f} s); medians of {rounds} rounds"
    )
    if different:
        return Line("FAIL", "async dump", f"loaded back, {len(different)} tensors differ; {figures}")
    return Line("PASS", "async dump", f"loaded back bitwise equal; {figures}")


def _raw_write(tensors: list[torch.Tensor], path: Path) -> float:
    """Seconds to write ``tensors`` (already in host memory) to one file and fsync it."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in tensors:
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
            while view:
                view = view[os.write(fd, view[: 64 << 20]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def check_throughput(device: str, mib: int, rounds: int, work: Path) -> list[Line]:
    """A bf16 HF export and an fp32 recovery dump of GPU tensors against raw write + fsync. The
    export runs through one async Saver (what mode auto picks for a model on a GPU; the same path
    in a CPU rehearsal), timed until each export is durable; the last one is loaded back with
    ``from_pretrained``, bitwise."""
    lines = []
    for name, dtype in (("export", torch.bfloat16), ("dump", torch.float32)):
        model, optimizer = _trained(mib, dtype, device)
        tensors = state_tensors(model, optimizer) if name == "dump" else list(model.state_dict().values())
        host = [tensor.detach().cpu().contiguous() for tensor in tensors]
        size = sum(t.numel() * t.element_size() for t in host) / GB
        config = ac.SaverConfig(
            experiment_name="gpu", trial_name="t", fileroot=str(work / "exports"), user="gpu", mode="async"
        )
        saver = ac.Saver(config, SPEC) if name == "export" else None
        ours: list[float] = []
        blocked: list[float] = []
        raw: list[float] = []
        try:
            for index in range(rounds + 1):  # the first round warms up (writer started), untimed
                _sync(device)
                start = time.perf_counter()
                if saver is not None:
                    written_to = Path(str(saver.save(ac.TorchEngine(model), 0, index, index, force=True)))
                    returned = time.perf_counter() - start
                    saver.wait()  # the background commit: raises if the export failed
                else:
                    written_to = work / f"dump-{index}"
                    handler = ac.RecoverHandler(_recover_config(written_to, "dump", "sync"), SPEC)
                    handler.dump(ac.TorchEngine(model, optimizer=optimizer), _step(0), force=True)
                    handler.close()
                    returned = time.perf_counter() - start
                took = time.perf_counter() - start
                written = _raw_write(host, work / "raw.bin")
                if index:
                    ours.append(took)
                    blocked.append(returned)
                    raw.append(written)
                if name == "export" and index == rounds:
                    _check_export(model, written_to)
                shutil.rmtree(written_to, ignore_errors=True)
        finally:
            if saver is not None:
                saver.finalize()
        ratio = statistics.median(r / o for r, o in zip(raw, ours))
        what = (
            "bf16 HF export (async Saver), loaded back bitwise,"
            if name == "export"
            else "fp32 + AdamW recovery dump (sync)"
        )
        lines.append(
            Line(
                "PASS",
                name,
                f"{what} of {size:.2f} GB from the device: {size / statistics.median(ours):.2f} GB/s until durable "
                f"(the loop blocked {statistics.median(blocked):.3f} s), {ratio:.2f}x a buffered write + fsync of "
                f"the same bytes from host memory ({size / statistics.median(raw):.2f} GB/s); medians of {rounds} rounds",
            )
        )
        del model, optimizer, host
    return lines


def _check_export(model: torch.nn.Module, folder: Path) -> None:
    """Raises unless ``folder`` loads with ``from_pretrained`` into ``model``'s weights, bitwise."""
    loaded = type(model).from_pretrained(folder, dtype=torch.bfloat16).state_dict()
    mine = model.state_dict()
    if loaded.keys() != mine.keys():
        raise AssertionError(f"the export {folder} loads other tensors: {sorted(loaded.keys() ^ mine.keys())[:5]}")
    different = [key for key, tensor in mine.items() if not torch.equal(_local(tensor), loaded[key])]
    if different:
        raise AssertionError(f"the export {folder} loads other weights: {different[:5]} differ")


def _fill_worker(rank: int, port: int, device: str, work: str, result: str) -> None:
    """One of two ranks (two nodes): dump, node 1's tier deleted, restart from node 0's copies."""
    from torch.distributed.fsdp import fully_shard

    outcome: dict[str, object] = {}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        torch_dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=2)

        def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            model = model_of_size(32, torch.float32).to(device)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.arange(32, device=device).reshape(2, 16)
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            return model, optimizer

        def config() -> ac.RecoverConfig:
            return _recover_config(
                Path(work) / "remote",
                "fill",
                "sync",
                local_dir=f"{work}/node{rank}",
                local_replicas=1,
                upload_every=10**6,
            )

        model, optimizer = sharded()
        handler = ac.RecoverHandler(config(), SPEC)
        handler.dump(ac.TorchEngine(model, optimizer=optimizer), _step(1), force=True)
        handler.wait()
        handler.close()
        torch_dist.barrier()
        if rank == 1:
            shutil.rmtree(f"{work}/node1")
        torch_dist.barrier()
        fresh = _perturbed(*sharded())
        loader = ac.RecoverHandler(config(), SPEC)
        start = time.perf_counter()
        info = loader.load(ac.TorchEngine(fresh[0], optimizer=fresh[1]))
        outcome["seconds"] = time.perf_counter() - start
        loader.close()
        outcome["step"] = None if info is None else info.last_step_info.global_step
        outcome["different"] = len(_same_state(model, optimizer, fresh))
        outcome["node1_files"] = sum(1 for path in Path(f"{work}/node1").rglob("*.distcp"))
        torch_dist.destroy_process_group()
    except Exception as error:  # reported by the parent, named
        outcome["error"] = f"{type(error).__name__}: {error}"
        outcome["trace"] = traceback.format_exc()[-2000:]
    Path(f"{result}.{rank}").write_text(json.dumps(outcome))


def check_fill(device: str, work: Path) -> Line:
    """Peer copies and the restart's fill over the job's process group (NCCL on a GPU)."""
    name = "peer copies over NCCL" if device == "cuda" else "peer copies over gloo"
    result = work / "fill-result"
    ranks = mp.start_processes(
        _fill_worker, args=(free_port(), device, str(work), str(result)), nprocs=2, start_method="spawn", join=False
    )
    deadline = time.monotonic() + FILL_SECONDS
    try:
        while not ranks.join(timeout=5):
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                return Line("FAIL", name, f"the two ranks had not finished after {FILL_SECONDS} s: stopped")
    except Exception as error:  # a rank that died without reporting
        return Line("FAIL", name, f"a rank died: {error}")
    outcomes = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(2)]
    errors = [f"rank {rank}: {outcome['error']}" for rank, outcome in enumerate(outcomes) if "error" in outcome]
    if errors and device == "cuda" and torch.cuda.device_count() < 2 and "nccl" in " ".join(errors).lower():
        return Line("NOT RUN", name, f"NCCL refuses two ranks on this machine's one GPU ({errors[0][:300]})")
    if errors:
        return Line("FAIL", name, "; ".join(errors)[:600])
    if any(o["step"] != 1 or o["different"] for o in outcomes) or not outcomes[1]["node1_files"]:
        return Line("FAIL", name, f"restart after node 1 lost its tier: {outcomes}")
    return Line(
        "PASS",
        name,
        f"2 ranks as 2 nodes, FSDP2, local_replicas 1: node 1's tier deleted, the restart assembled it from node "
        f"0's copies and loaded it bitwise equal in {max(o['seconds'] for o in outcomes):.2f} s; node 1 holds "
        f"{outcomes[1]['node1_files']} data files again once the background copy is done",
    )
