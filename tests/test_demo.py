"""`make demo`'s job: a GRPO run killed part-way, restarted by its launcher, resumed, finished."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from areal_ckpt.tools.launch import ATTEMPT_VARIABLE

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
    assert exports == ["epoch1epochstep7globalstep15", "epoch2epochstep7globalstep23"]  # keep_last: 2
    assert "exports written after steps [7, 15, 23]; keep_last 2 kept [15, 23] and removed [7]" in output
    (trial,) = tmp_path.glob("checkpoints/*/grpo-digits/trial0")
    assert f"TRIAL={trial}\n    areal-ckpt list $TRIAL" in output  # the path the README's commands use
    assert (tmp_path / "reports/grpo-digits/trial0/report.png").stat().st_size > 10_000
    assert re.search(r"recover +actor,ref +23 ", output)


def test_demo_training_run_twice_without_the_launcher_finishes_both_times(tmp_path):
    """Outside `areal-ckpt launch` the demo's kill step never fires (its --help says so): the
    first plain run trains to the end, the second resumes after the last step and finishes."""
    config = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    config["demo"].update(epochs=1, kill_at_step=5)  # 8 steps, the kill step among them
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "areal_ckpt.demo.train", "--config", "demo.yaml", f"cluster.fileroot={tmp_path}"]
    env = {key: value for key, value in os.environ.items() if key != ATTEMPT_VARIABLE}
    env["HF_HUB_OFFLINE"] = "1"
    outputs = []
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "simulating a crash" not in done.stdout
        outputs.append(done.stdout)
    first, second = outputs
    assert "fresh start" in first and re.search(r"global +7 loss", first)
    assert "resuming from global step 8 (last dump after step 7" in second
    assert not re.search(r"global +\d+ loss", second), "the second run trained again"
    assert re.search(r"generate\('3\+4='\) -> '3\+4=", second)


def test_the_async_demo_killed_at_a_random_instant_trains_every_prompt_once_per_epoch(tmp_path):
    """`make demo-async`: its first attempt SIGKILLs itself at a random instant, the launcher
    relaunches it, the rollout frontier resumes with the weights, and the report counts every
    prompt trained on exactly once in each epoch."""
    config = str(ROOT / "configs/demo-async.yaml")
    job = [sys.executable, "-m", "areal_ckpt.demo.async_grpo", "--config", config, f"cluster.fileroot={tmp_path}"]
    command = [
        sys.executable,
        "-m",
        "areal_ckpt.cli.main",
        "launch",
        "--config",
        config,
        f"cluster.fileroot={tmp_path}",
    ]
    done = subprocess.run(
        [*command, "--", *job], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    output = done.stdout
    assert done.returncode == 0, output[-3000:] + done.stderr[-3000:]
    assert re.search(r"simulating a crash: SIGKILL [0-9.]+ s after step \d+", output)
    assert "attempt 1 failed with exit status 137; relaunch 1 of recover.retries=3" in done.stderr
    assert re.search(r"resumed after step \d+: \d+ finished rollouts back in the buffer, \d+ prompts", output)
    for epoch in (0, 1):
        assert (
            f"epoch {epoch}: 32 of 32 prompts trained on once, 0 skipped, 0 repeated: every prompt exactly once"
            in output
        )
    assert (tmp_path / "reports/grpo-async/trial0/report.png").stat().st_size > 10_000
