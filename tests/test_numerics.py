"""A load says once when this process computes differently from the one that dumped (the thread
count, the torch version): the resumed run is then correct but not bit-identical."""

from __future__ import annotations

import json
import logging

import pytest
import threads
import torch
from recover_fixtures import SPEC, committed_generation, dump_once, make_setup, recover_config, train_step

import areal_ckpt as ac
from areal_ckpt.paths import RECOVER_MANIFEST
from areal_ckpt.publish import render_manifest

OTHER = threads.THREADS + 1


@pytest.fixture
def restore_threads():
    """The suite's thread count again after a test that changes it."""
    yield
    threads.pin()


def _numerics_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "computes differently" in r.getMessage()
    ]


def test_a_dump_records_its_thread_count_and_torch_version(fileroot):
    dump_once(fileroot)
    manifest = json.loads((committed_generation(fileroot) / RECOVER_MANIFEST).read_text())
    assert manifest["torch_num_threads"] == threads.THREADS == torch.get_num_threads()
    assert manifest["torch_version"] == torch.__version__


def test_a_load_with_another_thread_count_warns_once_and_following_the_hint_silences_it(
    fileroot, caplog, restore_threads
):
    dump_once(fileroot)
    torch.set_num_threads(OTHER)
    info = ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert info is not None and info.last_step_info.global_step == 1  # the load itself goes on
    (warning,) = _numerics_warnings(caplog)
    assert str(committed_generation(fileroot)) in warning
    assert f"intra-op threads {threads.THREADS} -> {OTHER}" in warning
    assert f"OMP_NUM_THREADS={threads.THREADS} or call torch.set_num_threads({threads.THREADS})" in warning

    caplog.clear()
    torch.set_num_threads(threads.THREADS)  # the hint
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    assert _numerics_warnings(caplog) == []


def test_a_dump_from_another_torch_version_is_named_at_load(fileroot, caplog):
    dump_once(fileroot)
    manifest_path = committed_generation(fileroot) / RECOVER_MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["torch_version"] = "2.12.0"
    manifest_path.write_bytes(render_manifest(manifest))  # with its own checksum, as a dump writes it
    ac.RecoverHandler(recover_config(fileroot), SPEC).load(make_setup(seed=1).engine)
    (warning,) = _numerics_warnings(caplog)
    assert f"torch 2.12.0 -> {torch.__version__}" in warning and "intra-op threads" not in warning


def test_deepspeed_shaped_load_warns_for_a_continued_run_only(tmp_path, caplog, restore_threads):
    setup = make_setup()
    train_step(setup, 0)
    ac.save_checkpoint(setup.engine, tmp_path, tag="step1")
    torch.set_num_threads(OTHER)
    ac.load_checkpoint(make_setup(seed=1).engine, tmp_path, load_module_only=True)
    assert _numerics_warnings(caplog) == []  # weights taken for something else: nothing to keep exact
    ac.load_checkpoint(make_setup(seed=1).engine, tmp_path)
    (warning,) = _numerics_warnings(caplog)
    assert str(tmp_path / "step1") in warning and f"intra-op threads {threads.THREADS} -> {OTHER}" in warning
