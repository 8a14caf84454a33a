"""What every benchmark script shares: the machine's description, scratch folders, a
model-shaped state of a given size, page-cache eviction and the peak resident memory."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def machine_description() -> str:
    """Cores and memory of this machine, for the report's first line."""
    return f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def zero_engine(model: torch.nn.Module, stage: int):  # type: ignore[no-untyped-def]
    """``deepspeed.initialize`` of ``model`` under ZeRO ``stage`` with AdamW (lr 1e-4), one
    micro-batch of 1, every ZeRO-3 parameter partitioned (imports DeepSpeed)."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config
    )
    return engine


def scratch_folder(prefix: str) -> Path:
    """A new folder to write into: under ./runs (ignored by git) when it exists."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=Path("runs").absolute() if Path("runs").is_dir() else None))


def model_of_size(mib: int, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A Qwen2 whose fp32 state is about ``mib`` MiB (hidden 1024, vocab 8192, as many layers as
    fit); below 96 MiB, whose embeddings alone would pass it, hidden 256 and vocab 2048 (a quick
    rehearsal's model)."""
    hidden, inter, vocab = (1024, 2816, 8192) if mib >= 96 else (256, 704, 2048)
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


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a dump writes: the weights and the optimizer's state."""
    tensors = list(model.state_dict().values())
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


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


def size_and_rounds(doc: str, size: int, size_help: str) -> argparse.ArgumentParser:
    """The command line of a benchmark measured at one model size over rounds: ``--size``,
    ``--rounds``, ``--out`` (a script adds its own options to what this returns)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=size, help=size_help)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    return parser


def publish(text: str, out: str | None) -> int:
    """Print a benchmark's report and write it to ``out`` when given; the exit status."""
    print(text)
    if out:
        Path(out).write_text(text)
    return 0
