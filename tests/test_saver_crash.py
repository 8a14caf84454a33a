"""SIGKILL during an export leaves every committed export intact; the next Saver cleans up."""

from __future__ import annotations

import os
import signal
import time
import zlib
from pathlib import Path

import crash_child
import pytest
import torch
from crash_child import CONFIG_FIELDS, model_for_step
from distributed import start_processes
from helpers import export_names, manifest, read_export_tensors
from transformers import AutoModelForCausalLM

import areal_ckpt as ac


def staging_has_shards(count: int):
    def ready(staging: Path) -> bool:
        return len(list(staging.glob("model-*.safetensors"))) >= count

    return ready


def staging_in_metadata_phase(staging: Path) -> bool:
    return (staging / "config.json").exists()


def kill_during_export(fileroot: Path, ready) -> Path:
    """Start the child, wait until one export is committed and the next one's staging is
    ``ready``, SIGKILL the child and return that staging folder."""
    model_root = fileroot / "checkpoints/tester/exp/crash/default"
    (child,) = start_processes(crash_child.run, 1, str(fileroot))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            assert child.is_alive(), f"child exited early with code {child.exitcode}"
            if model_root.is_dir() and export_names(model_root):
                for staging in model_root.glob(".export-staging.*"):
                    try:
                        if ready(staging):
                            os.kill(child.pid, signal.SIGKILL)
                            child.join()
                            return staging
                    except FileNotFoundError:
                        continue
        raise AssertionError("the kill point was never reached")
    finally:
        if child.is_alive():
            child.kill()
        child.join()


@pytest.mark.parametrize(
    "ready",
    [staging_has_shards(1), staging_has_shards(3), staging_in_metadata_phase],
    ids=["first-shard", "third-shard", "metadata"],
)
def test_kill_mid_export_keeps_committed_exports_loadable(fileroot, ready):
    staging = kill_during_export(fileroot, ready)
    model_root = staging.parent
    committed = export_names(model_root)
    assert committed, "at least one export had been committed before the kill"
    assert staging.exists(), "the kill happened while an export was being written"
    assert staging.name.removeprefix(".export-staging.") not in committed  # never visible under its name

    for leaf in committed:
        folder = model_root / leaf
        for name, entry in manifest(folder)["files"].items():
            data = (folder / name).read_bytes()
            assert entry == {"size": len(data), "crc32": zlib.crc32(data)}, f"{leaf}/{name}"
        step = int(leaf.rsplit("globalstep", 1)[1])
        expected = model_for_step(step).state_dict()
        stored = read_export_tensors(folder)
        assert all(torch.equal(stored[name], expected[name]) for name in stored), leaf
    AutoModelForCausalLM.from_pretrained(model_root / committed[-1], local_files_only=True)

    ac.Saver(
        ac.SaverConfig(fileroot=str(fileroot), **CONFIG_FIELDS),
        ac.FinetuneSpec(total_train_epochs=1, dataset_size=10, train_batch_size=1),
    )
    assert not staging.exists()
    assert export_names(model_root) == committed
