"""What each `areal-ckpt` command does, once :mod:`areal_ckpt.cli.main` has parsed its line.

Each command imports what it needs when it runs (torch, transformers, a cloud's SDK), so the
commands that read no tensors start at once. Each returns its exit code; errors are raised
(CheckpointError, ValueError, OSError) for :func:`areal_ckpt.cli.main.main` to print.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from areal_ckpt.cli import format as fmt
from areal_ckpt.config import parse_size
from areal_ckpt.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from areal_ckpt.tools.place_contract import CheckpointPlace

logger = logging.getLogger(__name__)


def place_of(value: str, what: str) -> CheckpointPlace:
    """:func:`areal_ckpt.tools.places.place_of`, imported when a command first needs it."""
    from areal_ckpt.tools.places import place_of as resolve

    return resolve(value, what)


def cmd_inspect(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="areal-ckpt-inspect-") as scratch:  # for a copy, if one is needed
        facts = place_of(args.path, "path").describe(Path(scratch))
    if args.json:
        print(json.dumps(facts, indent=1))
        return 0
    rows = [
        ["kind", facts["kind"]],
        ["path", facts["path"]],
        ["step", fmt.step(facts.get("step"))],
        ["world size", str(facts.get("world_size") or "-")],
        ["created", fmt.when(facts.get("created_unix"))],
        ["size", f"{fmt.size(facts['bytes'])} in {facts['files']} files"],
        ["complete", {True: "yes", False: "NO", None: "unknown (no manifest)"}[facts["complete"]]],
    ]
    for held in facts.get("held", []):
        rows.append([f"holds {held['generation']}", fmt.holding(held)])
    if facts["kind"] == "export":
        rows.insert(3, ["parameters", f"{facts['parameters']:,}"])
        rows.insert(4, ["dtypes", ", ".join(f"{k} ({v:,})" for k, v in facts["dtypes"].items())])
    elif facts["kind"] == "dcp":
        rows[-1] = ["complete", "unknown (stock DCP keeps no checksums)"]
        for group, info in facts["groups"].items():
            rows.append(
                [
                    f"keys {group}.*",
                    f"{info['tensors']:,} tensors, {info['elements']:,} elements "
                    f"({', '.join(info['dtypes']) or 'no tensors'})",
                ]
            )
    else:
        for model, info in facts["models"].items():
            dtypes = ", ".join(info["dtypes"])
            rows.append(
                [
                    f"model {model}",
                    f"{info['parameters']:,} parameters ({dtypes}), {fmt.size(info['bytes'])}, "
                    f"optimizer {'yes' if info['optimizer'] else 'no'}",
                ]
            )
    fmt.print_table(rows)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from areal_ckpt.tools.catalog import verify_found

    place = place_of(args.path, "path")
    results = verify_found(place.found(), progress=fmt.progress(place.unit))
    bad = 0
    for checkpoint, problems in results:
        if problems:
            bad += 1
            print(f"BAD  {checkpoint}: " + "; ".join(problems))
        else:
            print(f"OK   {checkpoint}: every file matches its manifest")
    if bad:
        print(f"{args.path}: {bad} of {len(results)} checkpoint(s) damaged; do not load those", file=sys.stderr)
        return 1
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    entries = place_of(args.trial_root, "trial-root").list()
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        from areal_ckpt.storage.foreign import foreign_recovery_layout
        from areal_ckpt.urls import locate

        where = locate(args.trial_root, "trial-root")
        found = foreign_recovery_layout(where) if isinstance(where, Path) else []
        if found:
            print(
                f"{args.trial_root}: no exports and no recovery checkpoint of areal_ckpt, but AReaL's own recovery "
                f"checkpoint ({', '.join(path.name for path in found)}): `areal-ckpt import-areal {args.trial_root}` "
                "makes it one a job resumes from"
            )
            return 0
        print(f"{args.trial_root}: no exports and no recovery checkpoint")
        return 0
    rows = [["kind", "model", "global step", "epoch", "size", "created", "path"]]
    for e in entries:
        rows.append(
            [
                e["kind"]
                + (" (DAMAGED)" if "problem" in e else "")
                + (" (with copies)" if e.get("copied_files") else ""),
                e["name"],
                str(e["global_step"]),
                str(e["epoch"]),
                fmt.size(e["bytes"]),
                fmt.when(e["created_unix"]),
                e["path"],
            ]
        )
    fmt.print_table(rows)
    return 0


#: How many times ``export`` starts again when a running job supersedes what it reads.
SUPERSEDED_ATTEMPTS = 3


def cmd_export(args: argparse.Namespace) -> int:
    """``export``; a recovery generation that a running job supersedes (and deletes) while it is
    read is read again from the newer one, up to :data:`SUPERSEDED_ATTEMPTS` times, then said so."""
    from areal_ckpt.tools.catalog import newest_recovery

    place, attempt = place_of(args.recover_dir, "recover-dir"), 1
    while True:
        read = newest_recovery(place.found)
        try:
            return _export_once(args)
        except (CheckpointError, OSError) as error:
            now = newest_recovery(place.found)
            if read is None or now == read:
                raise
            if attempt == SUPERSEDED_ATTEMPTS:
                raise CheckpointError(
                    f"{args.recover_dir}: generation {read} was superseded by {now} while read, {attempt} times in a "
                    "row (the job dumps faster than this export reads): run again, or export once the job stopped"
                ) from error
            logger.warning(
                "%s: %s was superseded by %s while read (%s); reading %s", args.recover_dir, read, now, error, now
            )
            attempt += 1


def _export_once(args: argparse.Namespace) -> int:
    from areal_ckpt.paths import is_stock_dcp
    from areal_ckpt.tensors import EXPORT_DTYPES
    from areal_ckpt.tools.convert import export_recovery, export_stock_dcp

    with tempfile.TemporaryDirectory(prefix="areal-ckpt-export-") as scratch:
        source = place_of(args.recover_dir, "recover-dir").readable(Path(scratch) / "source")
        output = place_of(args.out_dir, "out-dir")
        out_dir = output.output(Path(scratch))
        dtype = EXPORT_DTYPES[args.dtype] if args.dtype else None
        options = {"dtype": dtype, "max_shard_size": parse_size(args.max_shard_size), "progress": fmt.progress("shard")}
        config_from = Path(args.config_from) if args.config_from else None
        if is_stock_dcp(source):
            result = export_stock_dcp(source, out_dir, config_from, **options)
        else:
            result = export_recovery(
                source, out_dir, name=args.name, config_from=config_from, lora=args.lora, **options
            )
        _report(result.bytes, result.seconds, output.commit_output(result.path))
    return 0


def _report(size: int, seconds: float, where: str) -> None:
    print(f"exported {fmt.size(size)} in {seconds:.2f} s to {where}")


def cmd_convert_deepspeed(args: argparse.Namespace) -> int:
    from areal_ckpt.tensors import EXPORT_DTYPES
    from areal_ckpt.tools.convert import export_deepspeed

    with tempfile.TemporaryDirectory(prefix="areal-ckpt-convert-") as scratch:
        ds_dir, tag = place_of(args.ds_dir, "ds-dir").readable_tag(args.tag, Path(scratch) / "source")
        output = place_of(args.out_dir, "out-dir")
        result = export_deepspeed(
            ds_dir,
            output.output(Path(scratch)),
            tag=tag,
            dtype=EXPORT_DTYPES[args.dtype] if args.dtype else None,
            max_shard_size=parse_size(args.max_shard_size),
            config_dir=Path(args.config) if args.config else None,
            progress=fmt.progress("shard"),
        )
        _report(result.bytes, result.seconds, output.commit_output(result.path))
    return 0


def cmd_recover_pointer(args: argparse.Namespace) -> int:
    repointed = place_of(args.trial, "trial").repoint()
    for name, problems in repointed.skipped.items():
        print(f"SKIP {name}: {'; '.join(problems)}")
    if not repointed.changed:
        print(f"{repointed.record} already names {repointed.generation}, which is intact; nothing changed")
    else:
        print(
            f"OK   {repointed.record} -> {repointed.generation}: every file matches its manifest; the next start "
            "resumes from it"
        )
    return 0


def cmd_import_areal(args: argparse.Namespace) -> int:
    from areal_ckpt.tools.import_areal import import_areal_trial

    imported = import_areal_trial(
        Path(args.trial),
        None if args.config_from is None else Path(args.config_from),
        remove_original=args.remove_original,
    )
    step = imported.step_info
    if not imported.imported_now:
        print(
            f"OK   {args.trial}: nothing to import: it holds areal_ckpt's checkpoint {imported.generation.name} "
            f"(global step {step.global_step}) already"
        )
        if imported.originals is not None:
            print(f"AReaL's own folders are kept in {imported.originals}; delete it once the job has resumed")
        return 0
    print(
        f"OK   {args.trial}: AReaL's checkpoint after global step {step.global_step} (epoch {step.epoch}, step "
        f"{step.epoch_step}) of {', '.join(imported.models)} on {imported.world_size} rank(s) is now "
        f"{imported.generation.name}; the next start of the job resumes from it"
    )
    print(
        "note: AReaL's recovery checkpoints hold no LR scheduler state and no RNG streams; a load restores "
        "neither (see docs/migrating.md)"
    )
    if imported.unpublished:
        kept = "kept with AReaL's folders" if imported.originals is not None else "removed with AReaL's folders"
        print(
            f"note: {', '.join(imported.unpublished)}: newer than the generation AReaL's LATEST names, but never "
            f"published (a dump cut short); not imported, {kept}"
        )
    if imported.originals is not None:
        print(f"AReaL's own folders are kept in {imported.originals}; delete it once the job has resumed")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from areal_ckpt.config_loader import load_config
    from areal_ckpt.tools.launch import launch

    rest = list(args.rest)
    if "--" not in rest:
        raise ConfigError(
            "launch: put the job's command after '--', e.g. "
            "areal-ckpt launch --config job.yaml -- torchrun --nproc-per-node 2 train.py"
        )
    split = rest.index("--")
    config = load_config(args.config, rest[:split])
    return launch(config.recover, rest[split + 1 :])


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two checkpoints (:mod:`areal_ckpt.tools.diff`); exit 0 only when they are equal
    within the tolerance, 1 when they differ."""
    from areal_ckpt.tools.diff import diff_checkpoints

    with tempfile.TemporaryDirectory(prefix="areal-ckpt-diff-") as scratch:  # copies of URLs, if any
        first = place_of(args.first, "A").readable(Path(scratch) / "a")
        second = place_of(args.second, "B").readable(Path(scratch) / "b")
        result = diff_checkpoints(first, second, atol=args.atol, rtol=args.rtol)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0 if result.equal else 1
    print(f"A: {args.first} ({result.kinds[0]})\nB: {args.second} ({result.kinds[1]})")
    for name in result.unpaired_a:
        print(f"model {name}: only in A")
    for name in result.unpaired_b:
        print(f"model {name}: only in B")
    for section in result.sections:
        within = sum(1 for d in section.differing if d.within)
        label = section.a if section.a == section.b else f"{section.a} (A) / {section.b} (B)"
        print(
            f"model {label}: {section.compared} tensors compared, {section.compared - len(section.differing)} "
            f"equal bitwise, {len(section.differing)} differ ({within} within atol={args.atol:g} rtol={args.rtol:g})"
        )
        rows = [["tensor", "max |a-b|", "max relative", "within"]]
        rows += [
            [d.name, f"{d.max_abs:.3g}", f"{d.max_rel:.3g}", "yes" if d.within else "NO"] for d in section.differing
        ]
        if len(rows) > 1:
            fmt.print_table(rows)
        for change in section.changed:
            print(f"  changed {change['name']}: {change['a'][0]} {change['a'][1]} -> {change['b'][0]} {change['b'][1]}")
        if section.optimizer_only_in is not None:
            print(f"  optimizer state: only in {section.optimizer_only_in.upper()}, not compared")
        for name in section.only_a:
            print(f"  only in A: {name}")
        for name in section.only_b:
            print(f"  only in B: {name}")
    print("equal" if result.equal else "different")
    return 0 if result.equal else 1
