"""The methods `bench.py` times: each writes (durably) or reads the same model-shaped state one
way: raw bytes, torch.save, safetensors, DCP, DeepSpeed, save_pretrained, our Saver and
RecoverHandler."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from common import fsync_tree
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import areal_ckpt as ac


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
