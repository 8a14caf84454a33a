"""Step bookkeeping shared by the Saver, the RecoverHandler and training loops (pure data)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FinetuneSpec(BaseModel):
    """Run length: epochs, dataset size and batch size, from which steps per epoch follow."""

    model_config = ConfigDict(frozen=True)

    total_train_epochs: int = Field(gt=0)
    dataset_size: int = Field(gt=0)
    train_batch_size: int = Field(gt=0)
    # Match the dataloader: with drop_last an incomplete final batch is not a step.
    drop_last: bool = False

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


class StepInfo(BaseModel):
    """Position of a completed step: epoch, step within the epoch, global step (all from 0)."""

    model_config = ConfigDict(frozen=True)

    epoch: int = Field(ge=0)
    epoch_step: int = Field(ge=0)
    global_step: int = Field(ge=0)
    steps_per_epoch: int = Field(gt=0)

    def next(self) -> "StepInfo":
        """The step after this one, rolling over to the next epoch after its last step."""
        if self.epoch_step + 1 >= self.steps_per_epoch:
            return self.model_copy(
                update={"epoch": self.epoch + 1, "epoch_step": 0, "global_step": self.global_step + 1}
            )
        return self.model_copy(
            update={"epoch_step": self.epoch_step + 1, "global_step": self.global_step + 1}
        )
