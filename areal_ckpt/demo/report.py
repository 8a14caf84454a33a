"""The demo's closing report: checkpoints table, replay check, plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_ckpt.tools.inspection import list_trial


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every step record of every attempt, in the order written."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def replay_check(records: list[dict[str, Any]]) -> str:
    """Compare steps that ran more than once (before a crash and again after the resume)."""
    by_step: dict[int, set[str]] = {}
    for record in records:
        by_step.setdefault(record["global_step"], set()).add(record["loss"])
    replayed = sorted(step for step in by_step if sum(r["global_step"] == step for r in records) > 1)
    if not replayed:
        return "no step ran twice (the run was never interrupted between a dump and a crash)"
    differing = [step for step in replayed if len(by_step[step]) > 1]
    span = f"{replayed[0]}-{replayed[-1]}" if len(replayed) > 1 else str(replayed[0])
    if differing:
        return f"MISMATCH: steps {differing} gave different losses after the resume"
    return (
        f"steps {span} ran twice, before the crash and again after the resume: every loss is identical "
        "to the last bit, so the resumed run is the uninterrupted run"
    )


def checkpoint_table(trial: Path, records: list[dict[str, Any]]) -> list[str]:
    """One line per export and for the recovery checkpoint, with size and save time."""
    seconds: dict[tuple[str, int], float] = {}
    for record in records:
        for kind in ("export", "recover"):
            if record.get(f"{kind}_seconds") is not None:
                seconds[(kind, record["global_step"])] = record[f"{kind}_seconds"]
    lines = [f"{'kind':8} {'model':10} {'step':>5} {'size':>10} {'save s':>7}  path"]
    for entry in list_trial(trial):
        took = seconds.get((entry["kind"], entry["global_step"]))
        size = f"{entry['bytes'] / 2**20:.2f} MiB" if entry["bytes"] is not None else "-"
        lines.append(
            f"{entry['kind']:8} {entry['name']:10} {entry['global_step']!s:>5} {size:>10} "
            f"{'-' if took is None else f'{took:.2f}':>7}  {entry['path']}"
        )
    return lines


def retention_note(trial: Path, records: list[dict[str, Any]], keep_last: int | None) -> str:
    """Which exports the run wrote and which ``keep_last`` kept (the others were removed)."""
    written = sorted({r["global_step"] for r in records if r.get("export_seconds") is not None})
    kept = sorted(e["global_step"] for e in list_trial(trial) if e["kind"] == "export")
    removed = [step for step in written if step not in kept]
    return f"exports written after steps {written}; keep_last {keep_last} kept {kept}" + (
        f" and removed {removed}" if removed else ""
    )


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Reward per step (last attempt wins) with export and dump events; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest: dict[int, dict[str, Any]] = {}
    resumes, crashes = [], []
    previous: dict[str, Any] | None = None
    for record in records:
        if previous is not None and record["pid"] != previous["pid"]:
            resumes.append(record["global_step"])
            crashes.append(previous["global_step"])
        previous = record
        latest[record["global_step"]] = record
    steps = sorted(latest)
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.plot(steps, [latest[s]["reward"] for s in steps], marker="o", label="mean reward")
    axis.plot(steps, [latest[s]["kl"] for s in steps], label="KL to reference")
    for s in steps:
        if latest[s].get("export_seconds") is not None:
            axis.axvline(s, color="tab:green", alpha=0.3)
        if latest[s].get("recover_seconds") is not None:
            axis.axvline(s, color="tab:orange", alpha=0.3, linestyle="--")
    for s in resumes:
        axis.axvline(s - 0.5, color="tab:red", linewidth=2)
    for s in crashes:
        axis.axvline(s + 0.5, color="tab:red", linewidth=2, linestyle=":")
    axis.set_xlabel("global step")
    axis.set_title(
        "reward; green: HF export, orange dashed: recovery dump,\n"
        "red dotted: killed after this step, red: resumed from here (the steps between ran twice)"
    )
    axis.title.set_fontsize(8)
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
