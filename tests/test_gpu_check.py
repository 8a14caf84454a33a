"""`make gpu-check` (benchmarks/gpu_check.py) where there is no GPU: it refuses to pass, and its
checks run and pass on CPU tensors in the rehearsal, so the script a GPU machine runs once is
known to work up to the device it was written for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=cwd, env=environment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs for real")
def test_without_a_gpu_it_checks_nothing_and_exits_non_zero(tmp_path):
    done = _run("--out", str(tmp_path / "gpu.md"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device here" in done.stdout and "nothing was checked" in done.stdout
    assert not (tmp_path / "gpu.md").exists()


def test_the_rehearsal_on_cpu_runs_the_checks_and_says_it_is_no_gpu_result(tmp_path):
    # every check but the plain resume, whose code the FSDP2 one runs too (six jobs' start-up saved)
    checks = "resume fsdp2,async dump,throughput,peer copies"
    arguments = [
        "--rehearse-on-cpu",
        "--size",
        "8",
        "--rounds",
        "1",
        "--only",
        checks,
        "--out",
        str(tmp_path / "gpu.md"),
    ]
    done = _run(*arguments, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    for name in ("resume fsdp2 (gloo, 1 rank)", "async dump", "export", "dump", "peer copies over gloo"):
        assert any(line.startswith("PASS") and f" {name}: " in line for line in lines), (name, done.stdout)
    assert "bitwise equal to the run through" in done.stdout and "loaded back bitwise" in done.stdout
    assert "gpu-check: 5 passed, 0 failed, 0 not run (a rehearsal on CPU: these are not GPU results)" in done.stdout
    assert not (tmp_path / "gpu.md").exists(), "a rehearsal must not write the GPU figures' file"


def test_results_replace_the_marked_block_and_keep_the_page_around_it(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_check import RESULTS_BEGIN, RESULTS_END, write_results
    finally:
        sys.path.remove(str(SCRIPT.parent))
    page = tmp_path / "gpu.md"
    page.write_text(f"# GPU\n\nmethod\n\n{RESULTS_BEGIN}\nthe old run\n{RESULTS_END}\n\nfindings\n")
    write_results(page, "the new run")
    assert page.read_text() == f"# GPU\n\nmethod\n\n{RESULTS_BEGIN}\nthe new run\n{RESULTS_END}\n\nfindings\n"
    fresh = tmp_path / "new.md"
    write_results(fresh, "first")
    write_results(fresh, "second")
    assert fresh.read_text().count(RESULTS_BEGIN) == 1 and "second" in fresh.read_text()
    assert "first" not in fresh.read_text()
