"""`areal-ckpt`: inspect, verify, list and export checkpoints from a shell.

The command line: its parser and the entry point. What each command does lives in
:mod:`areal_ckpt.cli.commands`. Errors print one line plus a hint and exit non-zero; `--help`
works on every command and imports nothing heavy.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from areal_ckpt.cli import commands as cli_commands
from areal_ckpt.config import EXPORT_DTYPE_NAMES, LORA_EXPORTS
from areal_ckpt.errors import CheckpointError, ConfigError
from areal_ckpt.urls import local_path

_DESCRIPTION = (
    "Inspect, verify, list and export checkpoints written by areal_ckpt (and AReaL's and DeepSpeed's "
    "own), in a folder or at an object store URL (s3://, gs://, az://: the SDK's own environment variables "
    "give the endpoint and credentials). Exit 0: done; 1: a checkpoint is damaged (verify) or two differ "
    "(diff); 2: a wrong "
    "argument or nothing usable there; launch exits as its job did (128+N when preempted by signal N)."
)


def _add_output_options(command: argparse.ArgumentParser) -> None:
    """The HF output folder and how it is written, shared by the converting commands."""
    command.add_argument(
        "out_dir",
        help="new folder to create, or a new object store prefix (s3://, gs://, az://) to commit the export to",
    )
    command.add_argument("--dtype", choices=sorted(EXPORT_DTYPE_NAMES), help="exported floating-point dtype")
    command.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-ckpt", description=_DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="what a checkpoint folder is: kind, step, sizes, dtypes")
    inspect.add_argument(
        "path",
        help="a checkpoint folder, or an object store URL (s3://, gs://, az://) (that checkpoint is downloaded to read it)",
    )
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(run=cli_commands.cmd_inspect)

    check = commands.add_parser(
        "verify",
        help="check every file of a checkpoint (or of every checkpoint of a trial) "
        "against its manifest; one line each; exit 0 only if all are intact",
    )
    check.add_argument(
        "path",
        help="a checkpoint or trial folder, or an object store URL (s3://, gs://, az://) (objects are read where they lie)",
    )
    check.set_defaults(run=cli_commands.cmd_verify)

    listing = commands.add_parser("list", help="every export and the recovery checkpoint of a trial, newest first")
    listing.add_argument("trial_root", help="a trial folder, or its object store URL (s3://, gs://, az://)")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(run=cli_commands.cmd_list)

    export = commands.add_parser("export", help="recovery checkpoint (DCP) -> HuggingFace folder")
    export.add_argument(
        "recover_dir",
        help="trial folder, recover_info, or {name}/recover_checkpoint; or a stock DCP folder (dcp.save's own format); "
        "or a trial's object store URL",
    )
    _add_output_options(export)
    export.add_argument("--name", help="model to export when the checkpoint holds several")
    export.add_argument(
        "--config-from",
        help="the model's HF folder (config, tokenizer), e.g. the base model: needed for a stock DCP folder and "
        "for a dump of a plain nn.Module; otherwise it replaces what the dump recorded",
    )
    export.add_argument(
        "--lora",
        choices=LORA_EXPORTS,
        default="adapter",
        help="for a PEFT (LoRA) model: its adapter folder(s), the merged model, or both (docs/lora.md)",
    )
    export.set_defaults(run=cli_commands.cmd_export)

    convert = commands.add_parser("convert-deepspeed", help="DeepSpeed ZeRO checkpoint -> HuggingFace folder")
    convert.add_argument(
        "ds_dir",
        help="folder holding 'latest' and tag folders (ours or DeepSpeed's own), or the object store URL save_checkpoint wrote",
    )
    _add_output_options(convert)
    convert.add_argument("--tag", help="checkpoint tag (default: what 'latest' names)")
    convert.add_argument(
        "--config",
        help="folder with the model's config.json: needed for DeepSpeed's own layout (default: DS_DIR) and for a "
        "save_checkpoint of a plain nn.Module",
    )
    convert.set_defaults(run=cli_commands.cmd_convert_deepspeed)

    pointer = commands.add_parser(
        "recover-pointer", help="re-point a trial's lost or broken commit record at its newest intact generation"
    )
    pointer.add_argument(
        "trial", help="the trial folder ({fileroot}/checkpoints/{user}/{experiment}/{trial}), or its object store URL"
    )
    pointer.set_defaults(run=cli_commands.cmd_recover_pointer)

    importer = commands.add_parser(
        "import-areal",
        help="convert a trial written by AReaL's RecoverHandler into areal_ckpt's layout, in place",
        description="Convert the recovery checkpoint AReaL wrote in TRIAL (recover_info/, {name}/recover_checkpoint/; "
        "or the generation its LATEST names under checkpoint_generations/) into areal_ckpt's layout, atomically; "
        "the next start of the job resumes from AReaL's step. "
        "AReaL's folders are kept under TRIAL/areal_original/ unless --remove-original.",
    )
    importer.add_argument("trial", help="the trial folder ({fileroot}/checkpoints/{user}/{experiment}/{trial})")
    importer.add_argument(
        "--config-from",
        help="the model's HF folder (e.g. the base model): its config and "
        "tokenizer are kept with the checkpoint for `areal-ckpt export`",
    )
    importer.add_argument("--remove-original", action="store_true", help="delete AReaL's folders once imported")
    importer.set_defaults(run=cli_commands.cmd_import_areal)

    compare = commands.add_parser(
        "diff",
        help="compare two checkpoints tensor by tensor (optimizer state too); exit 0 only when equal",
        description="Compare two checkpoints of any kind areal-ckpt reads (HF exports, recovery checkpoints, "
        "DeepSpeed tags ours or DeepSpeed's, stock DCP), each a folder or an object store URL: tensors in one "
        "only, dtype or shape changes, and for each tensor both hold whether it is equal bit for bit, else the "
        "largest absolute and relative difference. Exit 0 when equal within --atol/--rtol, 1 when not.",
    )
    compare.add_argument("first", metavar="A", help="a checkpoint folder or an object store URL (s3://, gs://, az://)")
    compare.add_argument("second", metavar="B", help="the checkpoint to compare it with")
    compare.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    compare.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, as torch.allclose (default 0)")
    compare.add_argument("--json", action="store_true", help="machine-readable output")
    compare.set_defaults(run=cli_commands.cmd_diff)

    relaunch = commands.add_parser(
        "launch",
        help="run a training command; relaunch it after a crash, up to recover.retries times",
        description="Run COMMAND; while recovery is enabled in CONFIG, relaunch it after a failure up to "
        "recover.retries times (it resumes from its last recovery dump). Overrides "
        "(key.path=value) apply to CONFIG as the job applies them.",
    )
    relaunch.add_argument("--config", required=True, help="the job's YAML file (its recover: block is read)")
    relaunch.add_argument("rest", nargs=argparse.REMAINDER, metavar="[OVERRIDE ...] -- COMMAND ...")
    relaunch.set_defaults(run=cli_commands.cmd_launch)
    return parser


#: The arguments, by command, that name a folder the command reads: a local one must exist.
_READ_FOLDERS = {
    "inspect": ("path",),
    "verify": ("path",),
    "list": ("trial_root",),
    "export": ("recover_dir", "config_from"),
    "convert-deepspeed": ("ds_dir", "config"),
    "recover-pointer": ("trial",),
    "import-areal": ("trial", "config_from"),
    "diff": ("first", "second"),
}
#: The arguments of every command that name a file or folder.
_PATH_ARGUMENTS = (
    "path", "trial_root", "trial", "recover_dir", "ds_dir", "out_dir", "config_from", "config", "first", "second"
)  # fmt: skip
#: Those that may be an object storage URL instead (docs/storage.md), by command.
_URL_ARGUMENTS = {
    "inspect": {"path"},
    "verify": {"path"},
    "list": {"trial_root"},
    "export": {"recover_dir", "out_dir"},
    "convert-deepspeed": {"ds_dir", "out_dir"},
    "recover-pointer": {"trial"},
    "diff": {"first", "second"},
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        for name in _PATH_ARGUMENTS:  # a URL is refused where none is read, never taken for a local folder
            if isinstance(getattr(args, name, None), str) and name not in _URL_ARGUMENTS.get(args.command, ()):
                local_path(getattr(args, name), name.replace("_", "-"))
        _check_read_folders(args)
        return int(args.run(args))
    except (CheckpointError, ValueError, OSError) as error:
        print(f"areal-ckpt {args.command}: error: {error}", file=sys.stderr)
        if str(error).endswith(": not a folder"):  # a wrong path, not a damaged checkpoint
            print(
                "hint: give an existing folder (a trial, {fileroot}/checkpoints/{user}/{experiment}/{trial}, or a "
                "checkpoint in it) or an s3:// / gs:// / az:// URL",
                file=sys.stderr,
            )
        elif not isinstance(error, ConfigError) and any(words in str(error) for words in _ABOUT_WHAT_IS_THERE):
            print(
                "hint: `areal-ckpt verify PATH` names damaged files; `areal-ckpt list TRIAL` shows what exists",
                file=sys.stderr,
            )
        return 2


def _check_read_folders(args: argparse.Namespace) -> None:
    """CheckpointError ``{path}: not a folder`` for a local folder the command reads that is
    missing or no folder: a wrong argument, refused before the command imports anything heavy
    (torch, an SDK). A URL is left to the command. Read-only."""
    for name in _READ_FOLDERS.get(args.command, ()):
        value = getattr(args, name, None)
        if isinstance(value, str) and "://" not in value and not Path(value).expanduser().is_dir():
            raise CheckpointError(f"{Path(value).expanduser()}: not a folder")


#: What an error about a checkpoint's own files says (something missing, damaged, not found
#: there): then `verify` and `list` help. An error with a way out of its own (an output that
#: exists, credentials, a server that does not answer) gets no generic hint.
_ABOUT_WHAT_IS_THERE = (
    "damaged",
    "checksum",
    "missing",
    "truncated",
    "incomplete",
    "not a recovery checkpoint",
    "no committed checkpoint",
    "no such",
    "malformed",
    "not written by",
)


if __name__ == "__main__":
    sys.exit(main())
