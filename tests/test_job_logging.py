"""What a job of several ranks logs: a line every rank would log alike (a dump committed, the
data resumed) is said once per job, by rank 0, not once per rank; each rank still logs it at
DEBUG."""

from __future__ import annotations

import logging
from pathlib import Path

from distributed import run_distributed
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step

import areal_ckpt as ac


def _dump_and_load_logging_to_files(rank: int, world_size: int, root: str) -> None:
    for level in (logging.INFO, logging.DEBUG):  # what this rank's INFO and DEBUG handlers receive
        handler = logging.FileHandler(Path(root) / f"rank{rank}.{logging.getLevelName(level)}.log")
        handler.setLevel(level)
        logging.getLogger("areal_ckpt").addHandler(handler)
    logging.getLogger("areal_ckpt").setLevel(logging.DEBUG)
    setup = make_setup()
    recover = ac.RecoverHandler(recover_config(Path(root) / "fileroot", mode="sync"), SPEC)
    for step in range(2):
        train_step(setup, step)
        recover.dump(setup.engine, step_info(step), force=True)
    recover.close()
    ac.RecoverHandler(recover_config(Path(root) / "fileroot", mode="sync"), SPEC).load(make_setup(seed=1).engine)


def test_a_two_rank_job_says_each_dump_and_its_resume_once(tmp_path):
    # every INFO line of a 2-rank job appeared twice, once per rank
    run_distributed(_dump_and_load_logging_to_files, 2, str(tmp_path), group=True)
    said = {name: (tmp_path / f"{name}.log").read_text() for name in ("rank0.INFO", "rank1.INFO", "rank1.DEBUG")}
    for step in range(2):
        assert said["rank0.INFO"].count(f"recovery checkpoint at global step {step}:") == 1
        assert f"recovery checkpoint at global step {step}:" not in said["rank1.INFO"]
        assert f"recovery checkpoint at global step {step}:" in said["rank1.DEBUG"]  # kept, one level down
    assert "resuming trial" in said["rank0.INFO"] and "resuming trial" not in said["rank1.INFO"]
