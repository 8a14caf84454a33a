"""`make bench`: checkpoint write / read throughput against the disk's own limit, as ratios.

Every method saves the same model-shaped state (a Qwen2 built from a config: many tensors of
mixed sizes), durably (fsync). Disk speed on these machines swings by +-50%, so each method
runs right after a raw write of the same bytes and is measured against that pair (raw, A, raw,
B, ...), the order rotating from round to round; medians over rounds. Reads are paired the same
way: the method's files and the raw file written just before them are evicted from the page
cache (posix_fadvise(POSIX_FADV_DONTNEED) after an fsync) and read back to back, the order
alternating between rounds (so rounds come in pairs, one of each order; see `summary`). The
raw row paired with itself shows how much the disk drifts between two identical writes or
reads.

    python benchmarks/bench.py --sizes 256 1024 --rounds 4 --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from bench_targets import RAW_READ, RAW_WRITE, READERS, TARGETS, WRITERS, read_raw, write_raw
from common import PeakRss, evict, machine_description, model_of_size, scratch_folder, state_bytes

from areal_ckpt.formats import cache_fill

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _rotated(names: list[str], round_index: int, rounds: int) -> list[str]:
    """The order of one round: shifted each round so no method always runs at the same point."""
    shift = (round_index * max(1, len(names) // rounds)) % len(names)
    return names[shift:] + names[:shift]


def _timed(function: Callable, *args: object) -> float:
    """Seconds ``function`` took; the page-cache fill a cold load of ours starts in the
    background is waited for afterwards, untimed, so it never slows what is timed next."""
    gc.collect()
    start = time.perf_counter()
    function(*args)
    seconds = time.perf_counter() - start
    cache_fill.wait_for_fills()
    return seconds


def _timed_pair(
    first: tuple[Callable, Path], second: tuple[Callable, Path], model: torch.nn.Module
) -> tuple[float, float]:
    """Both reads timed, in the order given; both folders are evicted from the page cache first."""
    for _, folder in (first, second):
        evict(folder)
    return _timed(first[0], model, first[1]), _timed(second[0], model, second[1])


def run(sizes: list[int], rounds: int, dtypes: list[torch.dtype], workdir: Path) -> list[dict]:
    """Every method, every size and dtype. Each method writes right after a raw write of the same
    bytes; then both files are evicted and read back, raw first in even rounds and the method
    first in odd ones. Its speed is taken relative to that raw pair: both files have the same
    history (written, evicted, read back to back), which matters on a VM where a read's speed
    depends on what ran just before it (see the notes in docs/benchmarks.md)."""
    results = []
    for dtype in dtypes:
        for mib in sizes:
            model = model_of_size(mib, dtype)
            size = state_bytes(model)
            writers = {n: w for n, w in WRITERS.items() if dtype == torch.float32 or "fp32 only" not in n}
            readers = {n: r for n, r in READERS.items() if r[0] in writers}
            times: dict[str, list[float]] = {name: [] for name in [*writers, *readers]}
            paired: dict[str, list[float]] = {name: [] for name in [*writers, *readers]}  # raw time / method time
            memory: dict[str, int] = {}
            for round_index in range(rounds):
                for name in _rotated(list(writers), round_index, rounds):
                    raw, folder = Path(tempfile.mkdtemp(dir=workdir)), Path(tempfile.mkdtemp(dir=workdir))
                    baseline = _timed(write_raw, model, raw)
                    evict(raw)
                    with PeakRss() as rss:
                        seconds = _timed(writers[name], model, folder)
                    memory[name] = max(memory.get(name, 0), rss.extra)
                    times[name].append(seconds)
                    paired[name].append(baseline / seconds)
                    for reader_name, (source, reader) in readers.items():
                        if source != name:
                            continue
                        if round_index % 2 == 0:
                            baseline, seconds = _timed_pair((read_raw, raw), (reader, folder), model)
                        else:
                            seconds, baseline = _timed_pair((reader, folder), (read_raw, raw), model)
                        times[reader_name].append(seconds)
                        paired[reader_name].append(baseline / seconds)
                    shutil.rmtree(raw)
                    shutil.rmtree(folder)
                print(f"  {dtype} {mib} MiB: round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)
            results.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "mib": mib,
                    "bytes": size,
                    "write": {n: statistics.median(times[n]) for n in writers},
                    "read": {n: statistics.median(times[n]) for n in readers},
                    "paired": paired,
                    "memory": memory,
                }
            )
            del model
    return results


def summary(name: str, ratios: list[float]) -> float:
    """One figure for a method's per-round ratios. Writes: their median. Reads alternate which
    file is read first, and on this VM the second of two cold reads is 1.5-3x slower than the
    first whatever the file (measured), so a plain median over rounds would follow the majority
    order: each pair of rounds (one of each order) gives the geometric mean of its two ratios,
    in which that effect cancels, and the figure is the median over those pairs."""
    if name not in READERS:
        return statistics.median(ratios)
    return statistics.median(math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2]))


def _target_ratio(paired: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """numerator's speed over denominator's, each relative to its raw pair, summarized over rounds."""
    if denominator in (RAW_WRITE, RAW_READ):
        return summary(numerator, paired[numerator])
    return summary(numerator, [n / d for n, d in zip(paired[numerator], paired[denominator])])


def report(results: list[dict], machine: str) -> str:
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {machine}; seconds are medians over rounds. Each method "
        "runs right after a raw write (or cold raw read) of the same bytes, and 'x raw' summarizes those "
        "paired ratios, so a disk that drifts during the run cancels out; the order of methods rotates each "
        "round. For writes it is the median over rounds. A read is paired with a cold read of the raw file "
        "written just before the method's files (both evicted, read back to back, which one first "
        "alternating by round); its 'x raw' is the median over pairs of rounds of the geometric mean of "
        "the two orders' ratios, because which read comes second matters more than the file here. "
        "GB/s = 10^9 bytes per second of state.",
        "",
    ]
    for result in results:
        gbps = lambda seconds: result["bytes"] / seconds / 1e9  # noqa: E731
        paired = result["paired"]
        lines += [
            f"### {result['dtype']}, {result['bytes'] / 2**20:.0f} MiB of state",
            "",
            "| write (durable) | seconds | GB/s | x raw write (paired) | peak extra RSS |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, seconds in result["write"].items():
            lines.append(
                f"| {name} | {seconds:.2f} | {gbps(seconds):.2f} | {summary(name, paired[name]):.2f} | "
                f"{result['memory'][name] / 2**20:.0f} MiB |"
            )
        lines += ["", "| read (cold cache) | seconds | GB/s | x raw read (paired) |", "| --- | --- | --- | --- |"]
        for name, seconds in result["read"].items():
            lines.append(f"| {name} | {seconds:.2f} | {gbps(seconds):.2f} | {summary(name, paired[name]):.2f} |")
        lines += ["", "| target | ratio | verdict |", "| --- | --- | --- |"]
        for label, numerator, denominator, minimum in TARGETS:
            ratio = _target_ratio(paired, numerator, denominator)
            lines.append(f"| {label} | {ratio:.2f} | {'PASS' if ratio >= minimum else 'FAIL'} |")
        budget = 0.1 * result["bytes"] + 256 * 2**20
        extra = result["memory"]["areal_ckpt recover dump"]
        lines.append(
            f"| sync dump peak extra memory <= 10% of state + 256 MiB | {extra / 2**20:.0f} MiB of "
            f"{budget / 2**20:.0f} MiB | {'PASS' if extra <= budget else 'FAIL'} |"
        )
        lines.append("")
    return "\n".join(lines)


def throughput_groups(results: list[dict]) -> list[tuple[str, dict[str, dict[str, float]]]]:
    """One group per measured state (``float32, 1099 MiB``): GB/s of each method, by direction."""
    return [
        (
            f"{r['dtype']}, {r['bytes'] / 2**20:.0f} MiB",
            {
                kind: {name: r["bytes"] / seconds / 1e9 for name, seconds in r[kind].items()}
                for kind in ("write", "read")
            },
        )
        for r in results
    ]


def groups_from_report(text: str) -> list[tuple[str, dict[str, dict[str, float]]]]:
    """The same groups read back from a report's tables (``--replot``): each ``### {state}``
    section's write and read rows, their GB/s column."""
    groups: list[tuple[str, dict[str, dict[str, float]]]] = []
    kind = None
    for line in text.splitlines():
        if line.startswith("### ") and line.endswith(" of state"):
            groups.append((line[4:].removesuffix(" of state"), {"write": {}, "read": {}}))
        elif line.startswith("| write") or line.startswith("| read"):
            kind = line.split()[1]
        elif groups and kind and line.startswith("| ") and not line.startswith("| ---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            try:
                groups[-1][1][kind][cells[0]] = float(cells[2])
            except (IndexError, ValueError):
                kind = None  # a table of another shape (the targets) ends the section's rows
        elif not line.startswith("|"):
            kind = None
    return groups


def plot(groups: list[tuple[str, dict[str, dict[str, float]]]], path: Path) -> None:
    """Horizontal bars: one panel per direction, one row per method, one colour per measured
    state, the legend below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = {kind: list(dict.fromkeys(name for _, g in groups for name in g[kind])) for kind in ("write", "read")}
    height = 0.8 / max(len(groups), 1)
    figure, axes = plt.subplots(1, 2, figsize=(13, 0.5 * max(len(m) for m in methods.values()) + 2.2))
    colours = plt.get_cmap("tab10").colors
    for axis, kind in zip(axes, ("write", "read")):
        names = methods[kind]
        for index, (label, group) in enumerate(groups):
            positions = [row + index * height for row in range(len(names))]
            axis.barh(
                positions,
                [group[kind].get(name, 0.0) for name in names],
                height,
                label=label,
                color=colours[index % 10],
            )
        axis.set_yticks([row + 0.4 - height / 2 for row in range(len(names))], names, fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("GB/s (higher is faster)")
        axis.set_title("durable write" if kind == "write" else "cold read", fontsize=10)
        axis.grid(axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(groups), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


NOTES_START = "<!-- notes: written by hand, kept when the tables are regenerated -->"
NOTES_END = "<!-- notes: end -->"


def kept_notes(report_path: Path) -> str:
    """The hand-written notes of an earlier report at ``report_path`` (between the markers), so a
    rerun replaces the tables but not their reading; an empty marked block when there are none."""
    previous = report_path.read_text() if report_path.exists() else ""
    start, end = previous.find(NOTES_START), previous.find(NOTES_END)
    if start < 0 or end < start:
        return f"{NOTES_START}\n{NOTES_END}"
    return previous[start : end + len(NOTES_END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="state sizes in MiB (fp32)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=4, help="an even number: reads alternate their order")
    parser.add_argument("--workdir", default=None, help="where to write (default: a temp folder under ./runs)")
    parser.add_argument("--out", default=None, help="write the Markdown report (and a PNG beside it) here")
    parser.add_argument("--replot", default=None, help="only redraw the PNG beside this report from its tables")
    args = parser.parse_args(argv)
    if args.replot:
        plot(groups_from_report(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    if args.rounds < 2 or args.rounds % 2:
        parser.error(
            f"--rounds {args.rounds}: need an even number >= 2, since every pair of rounds reads in both orders"
        )
    workdir = Path(args.workdir) if args.workdir else scratch_folder("bench-")
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args.sizes, args.rounds, [getattr(torch, d) for d in args.dtypes], workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, machine_description())
    print(text)
    if args.out:
        out = Path(args.out)
        png = out.with_suffix(".png")
        plot(throughput_groups(results), png)
        out.write_text(
            f"# Benchmarks\n\n![throughput against state size]({png.name})\n\n"
            f"Rerun: `make bench` (or `python benchmarks/bench.py --help`). Asynchronous saves: "
            f"[benchmarks-async.md](benchmarks-async.md); two ranks: "
            f"[benchmarks-multirank.md](benchmarks-multirank.md).\n\n{kept_notes(out)}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
