"""Typed agreement across real ranks (areal_ckpt.agree): every rank returns the same value, or
raises the same error naming the rank that failed; interruptions stay interruptions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import run_distributed

from areal_ckpt import agree
from areal_ckpt.errors import CheckpointError, TransientError


def _outcome(action) -> str:
    try:
        return f"value {action()!r}"
    except (Exception, KeyboardInterrupt) as error:
        return f"{type(error).__name__}: {error}"


def _cases(rank: int, world: int, out: str) -> None:
    def rank0_fails_with_os_error() -> str:
        raise OSError("disk full")

    def rank1_refuses() -> None:
        if rank == 1:
            raise CheckpointError("/ckpt/x: damaged")

    def rank1_interrupted() -> None:
        if rank == 1:
            raise KeyboardInterrupt

    def every_rank_transient() -> None:
        raise TransientError(f"busy on {rank}")

    report = {
        "decided": _outcome(lambda: agree.decided_by_rank0(lambda: f"made by {rank}", "decide")),
        "decided_fails": _outcome(lambda: agree.decided_by_rank0(rank0_fails_with_os_error, "decide")),
        "every_rank": _outcome(lambda: agree.on_every_rank(lambda: rank * 10, "work")),
        "one_rank_refuses": _outcome(lambda: agree.on_every_rank(rank1_refuses, "verify")),
        "interrupted": _outcome(lambda: agree.on_every_rank(rank1_interrupted, "write")),
        "transient": _outcome(lambda: agree.on_every_rank(every_rank_transient, "write")),
        "gathered": _outcome(lambda: agree.gathered_then_decided(lambda: rank + 1, sum, "commit")),
        "dealt": _outcome(lambda: agree.gathered_then_dealt(lambda: rank, lambda all_: [r * 2 for r in all_], "plan")),
        "same": _outcome(lambda: agree.require_same("tag", "tags")),
        "differ": _outcome(lambda: agree.require_same(f"tag{rank}", "tags")),
    }
    Path(f"{out}.{rank}").write_text(json.dumps(report))


@pytest.mark.dist
def test_every_rank_gets_the_same_value_or_the_same_error_naming_the_rank(tmp_path):
    out = tmp_path / "report"
    run_distributed(_cases, 2, str(out))
    rank0, rank1 = (json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2))
    assert rank0["decided"] == rank1["decided"] == "value 'made by 0'"
    assert rank0["decided_fails"] == rank1["decided_fails"] == "CheckpointError: decide: rank 0: OSError: disk full"
    assert (rank0["every_rank"], rank1["every_rank"]) == ("value 0", "value 10")  # each its own result
    assert rank0["one_rank_refuses"] == rank1["one_rank_refuses"] == "CheckpointError: verify: rank 1: /ckpt/x: damaged"
    assert rank1["interrupted"] == "KeyboardInterrupt: "  # its own interruption
    assert rank0["interrupted"] == "KeyboardInterrupt: write: rank 1 was interrupted"
    assert rank0["transient"] == rank1["transient"] == "TransientError: write: rank 0: busy on 0; rank 1: busy on 1"
    assert rank0["gathered"] == rank1["gathered"] == "value 3"
    assert (rank0["dealt"], rank1["dealt"]) == ("value 0", "value 2")
    assert rank0["same"] == rank1["same"] == "value None"
    assert rank0["differ"] == rank1["differ"] == "RankMismatchError: tags: ['tag0', 'tag1']"
