"""`make bench`: checkpoint write / read throughput against the disk's own limit, as ratios.

Every method saves the same model-shaped state (a Qwen2 built from a config: many tensors of
mixed sizes), durably (fsync). Disk speed on these machines swings by +-50%, so each method
runs right after a raw write of the same bytes and is measured against that pair (raw, A, raw,
B, ...), the order rotating from round to round; medians over rounds. Reads are paired the same
way: the method's files and the raw file written just before them are evicted from the page
cache (posix_fadvise(POSIX_FADV_DONTNEED) after an fsync) and read back to back, the order
alternating between rounds (so rounds come in pairs, one of each order; see `summary`). The
raw row paired with itself shows how much the disk drifts between two identical writes or
reads.

    python benchmarks/bench.py --sizes 256 1024 --rounds 4 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

import areal_ckpt as ac

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def machine_description() -> str:
    """Cores and memory of this machine, for the report's first line."""
    return f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"


def scratch_folder(prefix: str) -> Path:
    """A new folder to write into: under ./runs (ignored by git) when it exists."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=Path("runs").absolute() if Path("runs").is_dir() else None))


def model_of_size(mib: int, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A Qwen2 whose fp32 state is about ``mib`` MiB (hidden 1024, vocab 8192, as many layers as fit)."""
    hidden, inter, vocab = 1024, 2816, 8192
    per_layer = (4 * hidden * hidden // 2 + 3 * hidden * inter + 4 * hidden) * 4  # GQA halves k/v
    layers = max(1, round((mib * 2**20 - 2 * vocab * hidden * 4) / per_layer))
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype)


def evict(folder: Path) -> None:
    """fsync then drop every file under ``folder`` from the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def fsync_tree(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class PeakRss:
    """Samples resident memory every 5 ms while active: peak extra memory of what runs inside."""

    def __enter__(self) -> PeakRss:
        self.base = self._rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.extra = self.peak - self.base


# -- writers: each writes the state durably into an empty folder ------------------------------


def write_raw(model, folder: Path) -> None:
    with open(folder / "raw.bin", "wb", buffering=0) as handle:
        for tensor in model.state_dict().values():
            handle.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
        os.fsync(handle.fileno())


def write_raw_early_writeback(model, folder: Path) -> None:
    """The raw write with writeback started every 8 MiB, as our writers do: a stronger baseline."""
    from areal_ckpt.fsio import start_writeback

    with open(folder / "raw.bin", "wb", buffering=0) as handle:
        offset = started = 0
        for tensor in model.state_dict().values():
            offset += handle.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
            if offset - started >= 8 << 20:
                start_writeback(handle.fileno(), started, offset - started)
                started = offset
        os.fsync(handle.fileno())


def write_torch_save(model, folder: Path) -> None:
    torch.save(model.state_dict(), folder / "model.pt")
    fsync_tree(folder)


def write_safetensors(model, folder: Path) -> None:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    fsync_tree(folder)


def write_dcp(model, folder: Path) -> None:
    dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)


def write_dcp_hf(model, folder: Path) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(path=str(folder)), no_dist=True)
    fsync_tree(folder)


_DEEPSPEED: dict[int, object] = {}  # id(model) -> its DeepSpeed engine (initialize once per model)


def deepspeed_engine(model):
    """A ZeRO-0 DeepSpeed engine around ``model`` (CPU, gloo, a world of one), built once."""
    if id(model) not in _DEEPSPEED:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault(
            "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".cache/torch_extensions")
        )
        import deepspeed

        if not torch.distributed.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
        )
        _DEEPSPEED.clear()
        _DEEPSPEED[id(model)] = engine
    return _DEEPSPEED[id(model)]


def write_deepspeed(model, folder: Path) -> None:
    deepspeed_engine(model).save_checkpoint(str(folder))
    fsync_tree(folder)


def write_save_pretrained(model, folder: Path) -> None:
    model.save_pretrained(folder)
    fsync_tree(folder)


def write_saver(model, folder: Path) -> None:
    config = ac.SaverConfig(experiment_name="bench", trial_name="t", fileroot=str(folder), user="bench")
    saver = ac.Saver(config, ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
    saver.save(ac.TorchEngine(model), 0, 0, 0, force=True)
    saver.finalize()


def write_recover(model, folder: Path) -> None:
    config = ac.RecoverConfig(experiment_name="bench", trial_name="t", fileroot=str(folder), user="bench", mode="on")
    handler = ac.RecoverHandler(config, ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
    engine = ac.TorchEngine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0))  # stateless: model only
    handler.dump(engine, ac.StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=1), force=True)
    handler.close()


WRITERS: dict[str, Callable] = {
    "raw write+fsync": write_raw,
    "raw write+fsync, early writeback": write_raw_early_writeback,
    "torch.save": write_torch_save,
    "safetensors.save_file": write_safetensors,
    "dcp.save (FileSystemWriter)": write_dcp,
    "dcp HuggingFaceStorageWriter": write_dcp_hf,
    "save_pretrained": write_save_pretrained,
    "areal_ckpt Saver export": write_saver,
    "areal_ckpt recover dump": write_recover,
    "DeepSpeed save_checkpoint (fp32 only)": write_deepspeed,
}


# -- readers: each reads a cold copy written by the matching writer ----------------------------


def read_raw(model, folder: Path) -> None:
    """The plain raw read: 64 MiB at a time into new memory, as ``handle.read`` gives it."""
    with open(folder / "raw.bin", "rb", buffering=0) as handle:
        while handle.read(64 << 20):
            pass


_REUSED_BUFFER = bytearray(64 << 20)


def read_raw_reused_buffer(model, folder: Path) -> None:
    """The raw read into one buffer allocated (and faulted in) once: a stronger baseline, since a
    loader fills memory that exists already (the model's own tensors)."""
    with open(folder / "raw.bin", "rb", buffering=0) as handle:
        while handle.readinto(_REUSED_BUFFER):
            pass


def read_torch_load(model, folder: Path) -> None:
    torch.load(folder / "model.pt", weights_only=True)


def read_every_byte(tensors: Iterable[torch.Tensor]) -> None:
    """Touch every page of ``tensors``: weights a loader left memory-mapped count as read."""
    for tensor in tensors:
        tensor.sum()


def read_safetensors(model, folder: Path) -> None:
    read_every_byte(load_file(folder / "model.safetensors").values())


def read_dcp(model, folder: Path) -> None:
    state = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)


def read_from_pretrained(model, folder: Path) -> None:
    read_every_byte(AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype).state_dict().values())


def _saver_export(folder: Path) -> Path:
    return next(folder.glob("checkpoints/bench/bench/t/default/epoch*"))


def read_saver_export(model, folder: Path) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(_saver_export(folder), dtype=model.dtype)
    read_every_byte(loaded.state_dict().values())


def read_saver_export_shards(model, folder: Path) -> None:
    """The export's shards read as `read_safetensors` reads one file: the format alone, no model."""
    for shard in sorted(_saver_export(folder).glob("*.safetensors")):
        read_every_byte(load_file(shard).values())


def read_deepspeed(model, folder: Path) -> None:
    deepspeed_engine(model).load_checkpoint(str(folder))


def read_recover(model, folder: Path) -> None:
    config = ac.RecoverConfig(experiment_name="bench", trial_name="t", fileroot=str(folder), user="bench", mode="on")
    handler = ac.RecoverHandler(config, ac.FinetuneSpec(total_train_epochs=1, dataset_size=1, train_batch_size=1))
    handler.load(ac.TorchEngine(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0)))
    handler.close()


READERS: dict[str, tuple[str, Callable]] = {
    "raw read": ("raw write+fsync", read_raw),
    "raw read into a reused buffer": ("raw write+fsync", read_raw_reused_buffer),
    "torch.load": ("torch.save", read_torch_load),
    "safetensors load_file": ("safetensors.save_file", read_safetensors),
    "dcp.load": ("dcp.save (FileSystemWriter)", read_dcp),
    "from_pretrained (save_pretrained)": ("save_pretrained", read_from_pretrained),
    "from_pretrained (Saver export)": ("areal_ckpt Saver export", read_saver_export),
    "safetensors load_file (Saver export)": ("areal_ckpt Saver export", read_saver_export_shards),
    "areal_ckpt recover load": ("areal_ckpt recover dump", read_recover),
    "DeepSpeed load_checkpoint (fp32 only)": ("DeepSpeed save_checkpoint (fp32 only)", read_deepspeed),
}

TARGETS = [
    # (label, numerator, denominator, minimum ratio)
    ("recover dump >= 0.9x raw write", "areal_ckpt recover dump", "raw write+fsync", 0.9),
    ("HF export >= 0.9x safetensors.save_file", "areal_ckpt Saver export", "safetensors.save_file", 0.9),
    ("HF export faster than save_pretrained", "areal_ckpt Saver export", "save_pretrained", 1.0),
    ("recover load >= 0.9x raw read", "areal_ckpt recover load", "raw read", 0.9),
    ("export reload >= 0.9x safetensors load", "safetensors load_file (Saver export)", "safetensors load_file", 0.9),
    (
        "from_pretrained of the export >= 0.9x of save_pretrained's",
        "from_pretrained (Saver export)",
        "from_pretrained (save_pretrained)",
        0.9,
    ),
]


RAW_WRITE, RAW_READ = "raw write+fsync", "raw read"


def _rotated(names: list[str], round_index: int, rounds: int) -> list[str]:
    """The order of one round: shifted each round so no method always runs at the same point."""
    shift = (round_index * max(1, len(names) // rounds)) % len(names)
    return names[shift:] + names[:shift]


def _timed(function: Callable, *args: object) -> float:
    gc.collect()
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def _timed_pair(
    first: tuple[Callable, Path], second: tuple[Callable, Path], model: torch.nn.Module
) -> tuple[float, float]:
    """Both reads timed, in the order given; both folders are evicted from the page cache first."""
    for _, folder in (first, second):
        evict(folder)
    return _timed(first[0], model, first[1]), _timed(second[0], model, second[1])


def run(sizes: list[int], rounds: int, dtypes: list[torch.dtype], workdir: Path) -> list[dict]:
    """Every method, every size and dtype. Each method writes right after a raw write of the same
    bytes; then both files are evicted and read back, raw first in even rounds and the method
    first in odd ones. Its speed is taken relative to that raw pair: both files have the same
    history (written, evicted, read back to back), which matters on a VM where a read's speed
    depends on what ran just before it (see the notes in docs/benchmarks.md)."""
    results = []
    for dtype in dtypes:
        for mib in sizes:
            model = model_of_size(mib, dtype)
            size = state_bytes(model)
            writers = {n: w for n, w in WRITERS.items() if dtype == torch.float32 or "fp32 only" not in n}
            readers = {n: r for n, r in READERS.items() if r[0] in writers}
            times: dict[str, list[float]] = {name: [] for name in [*writers, *readers]}
            paired: dict[str, list[float]] = {name: [] for name in [*writers, *readers]}  # raw time / method time
            memory: dict[str, int] = {}
            for round_index in range(rounds):
                for name in _rotated(list(writers), round_index, rounds):
                    raw, folder = Path(tempfile.mkdtemp(dir=workdir)), Path(tempfile.mkdtemp(dir=workdir))
                    baseline = _timed(write_raw, model, raw)
                    evict(raw)
                    with PeakRss() as rss:
                        seconds = _timed(writers[name], model, folder)
                    memory[name] = max(memory.get(name, 0), rss.extra)
                    times[name].append(seconds)
                    paired[name].append(baseline / seconds)
                    for reader_name, (source, reader) in readers.items():
                        if source != name:
                            continue
                        if round_index % 2 == 0:
                            baseline, seconds = _timed_pair((read_raw, raw), (reader, folder), model)
                        else:
                            seconds, baseline = _timed_pair((reader, folder), (read_raw, raw), model)
                        times[reader_name].append(seconds)
                        paired[reader_name].append(baseline / seconds)
                    shutil.rmtree(raw)
                    shutil.rmtree(folder)
                print(f"  {dtype} {mib} MiB: round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
            results.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "mib": mib,
                    "bytes": size,
                    "write": {n: statistics.median(times[n]) for n in writers},
                    "read": {n: statistics.median(times[n]) for n in readers},
                    "paired": paired,
                    "memory": memory,
                }
            )
            del model
    return results


def summary(name: str, ratios: list[float]) -> float:
    """One figure for a method's per-round ratios. Writes: their median. Reads alternate which
    file is read first, and on this VM the second of two cold reads is 1.5-3x slower than the
    first whatever the file (measured), so a plain median over rounds would follow the majority
    order: each pair of rounds (one of each order) gives the geometric mean of its two ratios,
    in which that effect cancels, and the figure is the median over those pairs."""
    if name not in READERS:
        return statistics.median(ratios)
    return statistics.median(math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2]))


def _target_ratio(paired: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """numerator's speed over denominator's, each relative to its raw pair, summarized over rounds."""
    if denominator in (RAW_WRITE, RAW_READ):
        return summary(numerator, paired[numerator])
    return summary(numerator, [n / d for n, d in zip(paired[numerator], paired[denominator])])


def report(results: list[dict], machine: str) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}; seconds are medians over rounds. Each method "
        "runs right after a raw write (or cold raw read) of the same bytes, and 'x raw' summarizes those "
        "paired ratios, so a disk that drifts during the run cancels out; the order of methods rotates each "
        "round. For writes it is the median over rounds. A read is paired with a cold read of the raw file "
        "written just before the method's files (both evicted, read back to back, which one first "
        "alternating by round); its 'x raw' is the median over pairs of rounds of the geometric mean of "
        "the two orders' ratios, because which read comes second matters more than the file here. "
        "GB/s = 10^9 bytes per second of state.",
        "",
    ]
    for result in results:
        gbps = lambda seconds: result["bytes"] / seconds / 1e9  # noqa: E731
        paired = result["paired"]
        lines += [
            f"### {result['dtype']}, {result['bytes'] / 2**20:.0f} MiB of state",
            "",
            "| write (durable) | seconds | GB/s | x raw write (paired) | peak extra RSS |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, seconds in result["write"].items():
            lines.append(
                f"| {name} | {seconds:.2f} | {gbps(seconds):.2f} | {summary(name, paired[name]):.2f} | "
                f"{result['memory'][name] / 2**20:.0f} MiB |"
            )
        lines += ["", "| read (cold cache) | seconds | GB/s | x raw read (paired) |", "| --- | --- | --- | --- |"]
        for name, seconds in result["read"].items():
            lines.append(f"| {name} | {seconds:.2f} | {gbps(seconds):.2f} | {summary(name, paired[name]):.2f} |")
        lines += ["", "| target | ratio | verdict |", "| --- | --- | --- |"]
        for label, numerator, denominator, minimum in TARGETS:
            ratio = _target_ratio(paired, numerator, denominator)
            lines.append(f"| {label} | {ratio:.2f} | {'PASS' if ratio >= minimum else 'FAIL'} |")
        budget = 0.1 * result["bytes"] + 256 * 2**20
        extra = result["memory"]["areal_ckpt recover dump"]
        lines.append(
            f"| sync dump peak extra memory <= 10% of state + 256 MiB | {extra / 2**20:.0f} MiB of "
            f"{budget / 2**20:.0f} MiB | {'PASS' if extra <= budget else 'FAIL'} |"
        )
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, kind in zip(axes, ("write", "read")):
        for name in results[0][kind]:
            for dtype in sorted({r["dtype"] for r in results}):
                rows = [r for r in results if r["dtype"] == dtype and name in r[kind]]
                if not rows:
                    continue
                axis.plot(
                    [r["mib"] for r in rows],
                    [r["bytes"] / r[kind][name] / 1e9 for r in rows],
                    marker="o",
                    label=f"{name} ({dtype})",
                )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("model size class (MiB of fp32 state requested; see the tables for exact sizes)")
        axis.set_ylabel("GB/s")
        axis.set_title(f"{kind} throughput")
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


NOTES_START = "<!-- notes: written by hand, kept when the tables are regenerated -->"
NOTES_END = "<!-- notes: end -->"


def kept_notes(report_path: Path) -> str:
    """The hand-written notes of an earlier report at ``report_path`` (between the markers), so a
    rerun replaces the tables but not their reading; an empty marked block when there are none."""
    previous = report_path.read_text() if report_path.exists() else ""
    start, end = previous.find(NOTES_START), previous.find(NOTES_END)
    if start < 0 or end < start:
        return f"{NOTES_START}\n{NOTES_END}"
    return previous[start : end + len(NOTES_END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="state sizes in MiB (fp32)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=4, help="an even number: reads alternate their order")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp folder under ./runs)")
    parser.add_argument("--out", default=None, help="write the Markdown report (and a PNG beside it) here")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.rounds % 2:
        parser.error(
            f"--rounds {args.rounds}: need an even number >= 2, since every pair of rounds reads in both orders"
        )
    workdir = Path(args.workdir) if args.workdir else scratch_folder("bench-")
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args.sizes, args.rounds, [getattr(torch, d) for d in args.dtypes], workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, machine_description())
    print(text)
    if args.out:
        out = Path(args.out)
        png = out.with_suffix(".png")
        plot(results, png)
        out.write_text(
            f"# Benchmarks\n\n![throughput against state size]({png.name})\n\n"
            f"Rerun: `make bench` (or `python benchmarks/bench.py --help`). Asynchronous saves: "
            f"[benchmarks-async.md](benchmarks-async.md); two ranks: "
            f"[benchmarks-multirank.md](benchmarks-multirank.md).\n\n{kept_notes(out)}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
