"""`make demo`'s job: a GRPO run killed part-way, restarted by its launcher, resumed, finished."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_is_killed_resumes_by_itself_and_replays_identical_losses(tmp_path):
    command = [
        sys.executable,
        "-m",
        "areal_ckpt.demo",
        "--config",
        str(ROOT / "configs/demo.yaml"),
        f"cluster.fileroot={tmp_path}",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    output = done.stdout
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "simulating a crash: SIGKILL at global step 13" in output
    assert "areal-ckpt launch: attempt 1 failed with exit status 137; relaunch 1 of recover.retries=3" in done.stderr
    assert "resuming from global step 10 (last dump after step 9; kl_coef" in output
    losses: dict[int, set[str]] = {}
    for step, loss in re.findall(r"global +(\d+) loss (\S+)", output):
        losses.setdefault(int(step), set()).add(loss)
    assert sorted(losses) == list(range(24))
    assert all(len(values) == 1 for values in losses.values()), "a replayed step changed its loss"
    assert re.search(r"generate\('3\+4='\) -> '3\+4=", output)
    assert "replay check: steps 10-13 ran twice" in output and "identical to the last bit" in output
    exports = sorted(p.name for p in tmp_path.glob("checkpoints/*/grpo-digits/trial0/actor/epoch*"))
    assert exports == ["epoch0epochstep7globalstep7", "epoch1epochstep7globalstep15", "epoch2epochstep7globalstep23"]
    assert (tmp_path / "reports/grpo-digits/trial0/report.png").stat().st_size > 10_000
    assert re.search(r"recover +actor,ref +23 ", output)
