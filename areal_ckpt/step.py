"""Step bookkeeping shared by the Saver, the RecoverHandler and training loops (pure data).

Both classes are dataclasses with AReaL's fields, field order and arithmetic, so AReaL code that
builds them by position or keyword, or reads them with ``dataclasses.asdict``, runs unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")


@dataclass
class FinetuneSpec:
    """Run length: epochs, dataset size and batch size, from which steps per epoch follow.

    As in AReaL, an incomplete final batch is not a step (``dataset_size // train_batch_size``,
    the dataloader's ``drop_last``). ``drop_last=False`` (keyword only, ours) counts it.
    """

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int
    drop_last: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        _check_int("FinetuneSpec", "total_train_epochs", self.total_train_epochs, 1)
        _check_int("FinetuneSpec", "dataset_size", self.dataset_size, 0)
        _check_int("FinetuneSpec", "train_batch_size", self.train_batch_size, 1)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        if self.drop_last:
            return self.dataset_size // self.train_batch_size
        return -(-self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        """Optimizer steps in the whole run."""
        return self.total_train_epochs * self.steps_per_epoch

    def is_epoch_last_step(self, epoch_step: int) -> bool:
        """True on the last step of an epoch (``epoch_step`` counts from 0)."""
        return epoch_step == self.steps_per_epoch - 1


@dataclass
class StepInfo:
    """Position of a completed step: epoch, step within the epoch, global step (all from 0).

    Values of -1 are accepted, as AReaL uses them for "no step yet"; a dump requires a real step
    (see :meth:`check_completed`).
    """

    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int

    def __post_init__(self) -> None:
        for name in ("epoch", "epoch_step", "global_step"):
            _check_int("StepInfo", name, getattr(self, name), -1)
        _check_int("StepInfo", "steps_per_epoch", self.steps_per_epoch, 0)

    def next(self) -> StepInfo:
        """The step after this one, rolling over to the next epoch after its last step."""
        last = self.epoch_step == self.steps_per_epoch - 1
        return StepInfo(
            epoch=self.epoch + int(last),
            epoch_step=0 if last else self.epoch_step + 1,
            global_step=self.global_step + 1,
            steps_per_epoch=self.steps_per_epoch,
        )

    def check_completed(self) -> None:
        """Raise ValueError unless this names a completed step (counters >= 0, steps_per_epoch > 0)."""
        for name in ("epoch", "epoch_step", "global_step"):
            _check_int("StepInfo", name, getattr(self, name), 0)
        _check_int("StepInfo", "steps_per_epoch", self.steps_per_epoch, 1)

    def to_dict(self) -> dict[str, int]:
        """The four fields as a JSON-ready dict (as ``dataclasses.asdict``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StepInfo:
        """Build from :meth:`to_dict`'s output; ValueError names a missing, extra or invalid field."""
        if not isinstance(data, dict):
            raise ValueError(f"expected an object with the StepInfo fields, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"expected the fields {sorted(names)}, got {sorted(map(str, data))}")
        return cls(**data)
