#!/usr/bin/env python
"""Offline conversion of an areal_ckpt ``save_checkpoint`` tag to a full fp32 state dict.

``areal_ckpt.save_checkpoint`` puts this file into every save_dir as ``zero_to_fp32.py``, as
DeepSpeed does with its own: it needs torch and safetensors only (not areal_ckpt, not
DeepSpeed), so a checkpoint can be turned into weights anywhere::

    python zero_to_fp32.py SAVE_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
                           [--max_shard_size 5GB] [--exclude_frozen_parameters]

It checks every file it reads against the tag's manifest (size and CRC-32), reads tensors
through the JSON metadata (never a pickle), rebuilds the trained parameters in fp32 from the
fp32 master partitions of every rank (ZeRO 1-3), and writes ``pytorch_model.bin`` or
``model.safetensors`` (split at ``--max_shard_size``, with an index), every floating-point
tensor in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

MODEL = "model"
MANIFEST = "areal_ckpt_manifest.json"
DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class ConversionError(Exception):
    """The checkpoint cannot be converted; the message names the file and the cause."""


def read_json(path: Path) -> Any:
    """The JSON document at ``path``; ConversionError naming it when it is missing or broken."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConversionError(f"{path}: {error}") from None


def checked_files(tag: Path) -> dict[str, dict[str, int]]:
    """The manifest's records of the tag's model files, each file checked against its size and CRC-32."""
    files = read_json(tag / MANIFEST).get("files", {})
    model_files = {name: entry for name, entry in files.items() if name.startswith(f"{MODEL}/")}
    for name, entry in model_files.items():
        path = tag / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            raise ConversionError(f"{path}: missing or not {entry['size']} bytes, as the manifest records")
        crc = 0
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        if crc != entry["crc32"]:
            raise ConversionError(f"{path}: CRC-32 differs from the manifest's: the file is damaged")
    return model_files


def committed_folder(root: Path, tag: str | None) -> str | None:
    """In a save_dir copied from object storage (its ``.commits/`` log beside the tag folders,
    no ``latest`` file): the folder of the newest save of ``tag``, or of the newest save made
    with ``save_latest`` when ``tag`` is None; None when no record names one."""
    log = root / ".commits"
    records = sorted(log.glob("[0-9]" * 12 + ".json")) if log.is_dir() else []
    for record in reversed(records):
        body = read_json(record)
        folder = body.get("folder") if isinstance(body, dict) else None
        if not isinstance(folder, str) or "/" in folder or folder in ("", ".", ".."):
            continue
        if body.get("latest") if tag is None else body.get("tag") == tag:
            return folder
    return None


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP folder, whole, by our flat name (``model.<fqn>``, ``optim.<...>``)."""
    metadata = read_json(folder / "dcp_metadata.json")
    prefixes: dict[str, str] = metadata.get("key_prefixes", {})

    def ours(stored: str) -> str:
        for prefix in sorted(prefixes, key=len, reverse=True):
            if stored.startswith(prefix):
                return prefixes[prefix] + stored[len(prefix) :]
        return stored

    where = {(item["fqn"], tuple(item["offset"] or ())): item for item in metadata["storage"]}
    tensors = {}
    for stored, entry in metadata["tensors"].items():
        dtype = DTYPES[entry["dtype"]]
        whole = torch.empty(entry["size"], dtype=dtype)
        for chunk in entry["chunks"]:
            item = where[(stored, tuple(chunk["offsets"]))]
            with open(folder / item["file"], "rb") as handle:
                handle.seek(item["byte_offset"])
                data = bytearray(handle.read(item["length"]))
            values = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            target = whole
            for dim, (start, size) in enumerate(zip(chunk["offsets"], chunk["sizes"])):
                target = target.narrow(dim, start, size)
            target.copy_(values.reshape(chunk["sizes"]))
        tensors[ours(stored)] = whole
    return tensors


def fp32_state_dict(tag: Path, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
    """The model's full state dict: trained parameters from the fp32 masters, the rest as stored."""
    checked_files(tag)
    folder = tag / MODEL
    tensors = stored_tensors(folder)
    deepspeed = read_json(folder / "engine_state.json").get("deepspeed") or {}
    flat_shapes = deepspeed.get("flat_shapes") or {}
    model = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            fqn = name[len("model.") :]
            model[fqn] = tensor.reshape(flat_shapes[fqn]) if fqn in flat_shapes else tensor
    layout = deepspeed.get("masters") or []
    trained_names = {entry["name"] for entries in layout for entry in entries}
    world, stage = deepspeed.get("world_size", 1), deepspeed.get("zero_stage", 0)
    keys = [f"optim.rank{rank}.master.{group}" for rank in range(world) for group in range(len(layout))]
    if not all(key in tensors for key in keys):
        layout = []  # fp32 training: the weights themselves are the masters, stored once
    trained = {}
    for group, entries in enumerate(layout):
        partitions = [tensors[f"optim.rank{rank}.master.{group}"] for rank in range(world)]
        flat = torch.cat(partitions) if stage < 3 else None
        for entry in entries:
            numel = 1
            for size in entry["shape"]:
                numel *= size
            offset = entry["offset"]
            if flat is not None:
                piece = flat[offset : offset + numel]
            else:
                part = entry["partition"]
                piece = torch.cat([p[offset : offset + part] for p in partitions])[:numel]
            trained[entry["name"]] = piece.reshape(entry["shape"]).float().clone()
    if exclude_frozen_parameters and trained_names:
        model = {name: tensor for name, tensor in model.items() if name in trained_names}
    return {name: trained.get(name, tensor) for name, tensor in model.items()}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MiB`` or ``1000``."""
    text = text.strip().upper()
    for unit, factor in sorted(UNITS.items(), key=lambda pair: -len(pair[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def write(state_dict: dict[str, torch.Tensor], out: Path, max_shard_size: int, safe: bool) -> None:
    """The state dict as DeepSpeed's converter writes it: one file, or shards plus an index; fsync'd."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and filled + size > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    weights = "model.safetensors" if safe else "pytorch_model.bin"
    stem, suffix = weights.split(".", 1)
    names = (
        [weights]
        if len(shards) == 1
        else [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}" for i in range(1, len(shards) + 1)]
    )
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, shard in zip(names, shards):
        tensors = {name: state_dict[name].contiguous() for name in shard}
        if safe:
            save_file(tensors, out / file_name, metadata={"format": "pt"})
        else:
            torch.save(tensors, out / file_name)
        written.append(out / file_name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name in shard}
        index = out / f"{weights}.index.json"
        index.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        )
        written.append(index)
    for path in [*written, out]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def main(argv: list[str] | None = None) -> int:
    """Command line entry: convert, print where to, return 0; on a bad checkpoint print why, return 2."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "checkpoint_dir",
        help="the save_dir: it holds 'latest' (or, copied from object storage, '.commits') and the tags",
    )
    parser.add_argument("output_dir", help="folder for the state dict files")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: what 'latest' names)")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch.save")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.checkpoint_dir)
    try:
        tag = committed_folder(root, args.tag) or args.tag
        if tag is None:
            latest = root / "latest"
            if not latest.is_file():
                raise ConversionError(f"{latest}: missing; name the checkpoint with --tag")
            tag = latest.read_text().strip()
        if not (root / tag / MANIFEST).is_file():
            raise ConversionError(
                f"{root / tag}: no {MANIFEST}: not written by areal_ckpt.save_checkpoint (DeepSpeed's own "
                "checkpoints have DeepSpeed's zero_to_fp32.py)"
            )
        state_dict = fp32_state_dict(root / tag, args.exclude_frozen_parameters)
        state_dict = {name: t.float() if t.is_floating_point() else t for name, t in state_dict.items()}
        write(state_dict, Path(args.output_dir), parse_size(args.max_shard_size), args.safe_serialization)
    except ConversionError as error:
        print(f"zero_to_fp32.py: {error}", file=sys.stderr)
        return 2
    print(f"wrote {len(state_dict)} tensors to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
