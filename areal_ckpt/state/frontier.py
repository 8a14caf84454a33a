"""The async RL frontier: every prompt the rollout side took from the data source and the
trainer has not trained on yet, captured with the data source's position at one instant.

In asynchronous RL the rollout workers draw prompts ahead of the trainer. A prompt is *queued*
(taken from the data source, not handed to a worker yet: the rest of a batch), *generating*
(handed out by :meth:`RolloutFrontier.next`), or *finished* (its trajectory reported by
:meth:`RolloutFrontier.finished`, waiting for a train step); :meth:`RolloutFrontier.consumed`
forgets it. A recovery dump records all three and the data source's position as one snapshot
(:meth:`RolloutFrontier.snapshot`, under the frontier's lock), so a resume neither skips a
prompt in flight nor draws one twice: finished trajectories come back into the buffer, the
others are handed out again first, in the order they were drawn, with the seeds they had.

A prompt's seed is derived from the frontier's ``seed`` and the prompt's key (sha256), never
from an RNG stream, so a prompt re-issued after a resume samples as it would have (AReaL's
deterministic rollouts derive theirs from a request's identity the same way).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from areal_ckpt.errors import CheckpointError, ConfigError
from areal_ckpt.state import safe_json

QUEUED, GENERATING, FINISHED = "queued", "generating", "finished"
STATES = (QUEUED, GENERATING, FINISHED)

#: The data source's facts a frontier records and a load compares: a frontier drawn from one
#: data set, order or batching means nothing in another.
SOURCE_FIELDS = ("length", "batch_size", "drop_last", "sampler", "shuffle", "sampler_seed", "seed", "epochs")


@dataclass
class Prompt:
    """One prompt of the frontier: its ``key`` (``{epoch}:{identity}``), the prompt as the data
    source gave it, the epoch, its ``order`` among every prompt drawn (0, 1, ...), its seed,
    its state, the policy version it was last issued under (None while queued) and, once
    finished, when (``finished_order``) and its trajectory (tensors, and plain values)."""

    key: str
    prompt: Any
    epoch: int
    order: int
    seed: int
    state: str = QUEUED
    version: int | None = None
    finished_order: int | None = None
    trajectory: dict[str, Any] | None = None


@dataclass
class FrontierSnapshot:
    """What a dump records of a frontier, taken at one instant: its prompts (in draw order),
    the data source's facts (:data:`SOURCE_FIELDS`) and position (``loader``: its state in the
    epoch ``epoch``, None when that epoch has not started), the counters. Plain data."""

    source: dict[str, Any]
    epoch: int
    drawn_in_epoch: int
    draws: int
    finishes: int
    consumed: int
    version: int
    exhausted: bool
    loader: Any
    prompts: list[Prompt] = field(default_factory=list)

    def trajectory_bytes(self) -> int:
        """The bytes of the finished trajectories' tensors. Pure."""
        return sum(
            value.numel() * value.element_size()
            for prompt in self.prompts
            for value in (prompt.trajectory or {}).values()
            if isinstance(value, torch.Tensor)
        )


def prompt_seed(seed: int, key: str) -> int:
    """The sampling seed of the prompt ``key`` under the frontier seed ``seed``: the first 63
    bits of sha256 of both. Pure and the same in every process."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _describe_source(dataloader: Any, seed: int, epochs: int) -> dict[str, Any]:
    """The facts of ``dataloader`` a frontier records (:data:`SOURCE_FIELDS`); None where the
    loader has no such fact. Pure."""
    dataset = getattr(dataloader, "dataset", None)
    try:
        length = len(dataset) if dataset is not None else len(dataloader)
    except TypeError:
        length = None
    sampler = getattr(dataloader, "sampler", None)
    sampler_seed = getattr(sampler, "seed", None)
    generator = getattr(sampler, "generator", None)
    if sampler_seed is None and isinstance(generator, torch.Generator):
        sampler_seed = generator.initial_seed()
    return {
        "length": length,
        "batch_size": getattr(dataloader, "batch_size", None),
        "drop_last": getattr(dataloader, "drop_last", None),
        "sampler": None if sampler is None else type(sampler).__name__,
        "shuffle": getattr(sampler, "shuffle", None),
        "sampler_seed": sampler_seed if isinstance(sampler_seed, int) else None,
        "seed": seed,
        "epochs": epochs,
    }


class RolloutFrontier:
    """The rollout side's view of the data source, and what a recovery dump keeps of it.

    ``dataloader``: the data source, with ``state_dict`` / ``load_state_dict`` (torchdata's
    ``StatefulDataLoader``); a batch it yields as a list or tuple is a batch of prompts (AReaL's
    loaders collate to a list), anything else one prompt. It is read for ``epochs`` epochs
    (its sampler's ``set_epoch`` called at each one). ``identity``: a prompt's identity in
    the data set (its dataset index or id); by default its position in the epoch's order.
    ``seed``: what each prompt's seed derives from. ``max_trajectories`` and ``max_bytes``
    bound what a dump may hold (finished trajectories, their tensors' bytes): a larger frontier
    is a ConfigError at the dump, never a silent truncation.

    Thread-safe: the rollout threads call :meth:`next` and :meth:`finished`, the trainer
    :meth:`consumed`, and a dump takes its snapshot while they run.
    """

    def __init__(
        self,
        dataloader: Any,
        *,
        epochs: int = 1,
        identity: Callable[[Any], str | int] | None = None,
        seed: int = 0,
        max_trajectories: int = 4096,
        max_bytes: int = 4 << 30,
    ) -> None:
        if not (
            callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))
        ):
            raise ConfigError(
                f"RolloutFrontier: the data source ({type(dataloader).__name__}) has no state_dict / load_state_dict; "
                "give it a torchdata StatefulDataLoader, whose position a dump can record"
            )
        for name, value in (("epochs", epochs), ("max_trajectories", max_trajectories), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"RolloutFrontier: {name} must be a positive integer, got {value!r}")
        self.dataloader = dataloader
        self.epochs = epochs
        self.identity = identity
        self.seed = seed
        self.max_trajectories = max_trajectories
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._prompts: dict[str, Prompt] = {}  # every prompt of the frontier, by key
        self._queue: list[str] = []  # keys of queued prompts, in draw order
        self._iterator: Iterator[Any] | None = None  # the epoch in progress, None before it starts
        self._epoch = 0
        self._drawn_in_epoch = 0
        self._draws = 0
        self._finishes = 0
        self._consumed = 0
        self._version = 0
        self._exhausted = False

    # -- the rollout side ---------------------------------------------------------------

    def next(self) -> tuple[str, Any]:
        """The next prompt to generate for, and its key: after a load the prompts that were
        queued or generating, in their draw order, then new ones from the data source.
        StopIteration when the data source's epochs are all drawn and nothing is queued.
        Thread-safe; blocking while the data source produces a batch."""
        with self._lock:
            if not self._queue:
                self._draw()
            if not self._queue:
                raise StopIteration
            prompt = self._prompts[self._queue.pop(0)]
            prompt.state, prompt.version = GENERATING, self._version
            return prompt.key, prompt.prompt

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """:meth:`next` until StopIteration."""
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    def seed_of(self, key: str) -> int:
        """The sampling seed of the prompt ``key`` (:func:`prompt_seed`). Pure."""
        return prompt_seed(self.seed, key)

    def finished(self, key: str, trajectory: Mapping[str, Any]) -> None:
        """The rollout of ``key`` is done: ``trajectory`` (token ids, logprobs, rewards, masks...:
        tensors, or plain values JSON can hold) is kept, copied, until :meth:`consumed`.
        ValueError naming the key unless it is generating; naming the entry when a value can
        be stored neither as a tensor nor in JSON. Thread-safe."""
        kept: dict[str, Any] = {}
        for name, value in trajectory.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"RolloutFrontier.finished({key!r}): entry names must be non-empty, with no '/'")
            if isinstance(value, torch.Tensor):
                kept[name] = value.detach().to("cpu", copy=True).contiguous()
            else:
                try:
                    safe_json.encode(value, f"trajectory[{name!r}]")
                except TypeError as error:
                    raise ValueError(f"RolloutFrontier.finished({key!r}): {error}") from None
                kept[name] = value
        with self._lock:
            prompt = self._prompts.get(key)
            if prompt is None or prompt.state != GENERATING:
                state = "not in the frontier" if prompt is None else prompt.state
                raise ValueError(f"RolloutFrontier.finished: {key!r} is {state}, not generating")
            prompt.state, prompt.trajectory = FINISHED, kept
            prompt.finished_order = self._finishes
            self._finishes += 1

    def consumed(self, keys: Iterable[str]) -> None:
        """A train step used these finished prompts: they leave the frontier. ValueError
        naming a key that is not finished (nothing is forgotten then). Thread-safe."""
        keys = list(keys)
        with self._lock:
            wrong = [key for key in keys if key not in self._prompts or self._prompts[key].state != FINISHED]
            if wrong:
                raise ValueError(f"RolloutFrontier.consumed: {wrong[:5]} are not finished prompts of the frontier")
            for key in keys:
                del self._prompts[key]
            self._consumed += len(keys)

    def buffered(self) -> list[tuple[str, dict[str, Any]]]:
        """The finished prompts not consumed yet, with their trajectories, in the order they
        finished (after a load: what the dump held). Thread-safe."""
        with self._lock:
            done = sorted(
                (p for p in self._prompts.values() if p.state == FINISHED), key=lambda p: p.finished_order or 0
            )
            return [(p.key, dict(p.trajectory or {})) for p in done]

    # -- versions and counters (AReaL's staleness manager) -----------------------------------

    @property
    def version(self) -> int:
        """The policy version new rollouts are issued under (the trainer's weight version)."""
        return self._version

    def set_version(self, version: int) -> None:
        """The trainer published ``version``; prompts handed out from now on record it."""
        with self._lock:
            self._version = int(version)

    def counts(self) -> dict[str, int]:
        """How many prompts are queued, generating, finished (unconsumed), and consumed in
        all; thread-safe."""
        with self._lock:
            counts = dict.fromkeys(STATES, 0)
            for prompt in self._prompts.values():
                counts[prompt.state] += 1
            return {**counts, "consumed": self._consumed}

    def capacity(self, batch_size: int, max_head_offpolicyness: int) -> int:
        """How many more prompts may be handed out so that none is trained on more than
        ``max_head_offpolicyness`` versions after the one it was issued under, with
        ``batch_size`` prompts per train step (AReaL's staleness rule: samples issued or
        finished stay within ``(offpolicyness + version + 1) * batch_size``). May be negative."""
        with self._lock:
            in_flight = sum(1 for p in self._prompts.values() if p.state != QUEUED)
            return (max_head_offpolicyness + self._version + 1) * batch_size - (self._consumed + in_flight)

    # -- dump and load ------------------------------------------------------------------

    def snapshot(self) -> FrontierSnapshot:
        """Everything a dump records, at one instant (the lock held: no prompt is drawn,
        finished or consumed meanwhile). ConfigError naming the bound when the finished
        trajectories exceed ``max_trajectories`` or ``max_bytes``."""
        with self._lock:
            snapshot = FrontierSnapshot(
                source=_describe_source(self.dataloader, self.seed, self.epochs),
                epoch=self._epoch,
                drawn_in_epoch=self._drawn_in_epoch,
                draws=self._draws,
                finishes=self._finishes,
                consumed=self._consumed,
                version=self._version,
                exhausted=self._exhausted,
                loader=None if self._iterator is None else self.dataloader.state_dict(),
                prompts=[replace(p) for p in sorted(self._prompts.values(), key=lambda p: p.order)],
            )
        finished = sum(1 for p in snapshot.prompts if p.state == FINISHED)
        if finished > self.max_trajectories:
            raise ConfigError(
                f"RolloutFrontier: {finished} finished trajectories wait for a train step, more than "
                f"max_trajectories={self.max_trajectories}; consume them sooner or raise the bound"
            )
        if snapshot.trajectory_bytes() > self.max_bytes:
            raise ConfigError(
                f"RolloutFrontier: the finished trajectories hold {snapshot.trajectory_bytes()} bytes of tensors, more "
                f"than max_bytes={self.max_bytes}; consume them sooner or raise the bound"
            )
        return snapshot

    def check(self, snapshot: FrontierSnapshot, source: str) -> None:
        """CheckpointError naming ``source``, the field and both values unless ``snapshot`` was
        recorded from a data source like this frontier's (each of :data:`SOURCE_FIELDS` it
        records). Pure."""
        mine = _describe_source(self.dataloader, self.seed, self.epochs)
        for name in SOURCE_FIELDS:
            if name in snapshot.source and snapshot.source[name] != mine[name]:  # one an older record lacks: unknown
                raise CheckpointError(
                    f"{source}: the rollout frontier was recorded for another data source: {name} was "
                    f"{snapshot.source.get(name)!r}, this frontier's is {mine[name]!r}; give load the same data "
                    "source, or load without rollout= to start its data afresh"
                )

    def restore(self, snapshot: FrontierSnapshot) -> None:
        """Take ``snapshot`` (checked with :meth:`check`): the finished trajectories back in the
        buffer, queued and generating prompts queued again in draw order, the data source at
        the recorded position (CheckpointError when it refuses that position). Call it before
        the rollout side starts drawing."""
        with self._lock:
            self._prompts = {}
            for prompt in snapshot.prompts:
                again = prompt.state != FINISHED
                self._prompts[prompt.key] = replace(prompt, state=QUEUED, version=None) if again else replace(prompt)
            self._queue = [p.key for p in snapshot.prompts if p.state != FINISHED]
            self._epoch, self._drawn_in_epoch = snapshot.epoch, snapshot.drawn_in_epoch
            self._draws, self._finishes = snapshot.draws, snapshot.finishes
            self._consumed, self._version, self._exhausted = snapshot.consumed, snapshot.version, snapshot.exhausted
            self._iterator = None
            if snapshot.loader is not None:
                self._start_epoch()
                try:  # a loader may take the state lazily and refuse it when iterated
                    self.dataloader.load_state_dict(snapshot.loader)
                    self._iterator = iter(self.dataloader)
                except Exception as error:  # a forged or mismatched position: name it
                    raise CheckpointError(
                        f"RolloutFrontier: the data source could not take its recorded position: "
                        f"{type(error).__name__}: {error}"
                    ) from None

    # -- the data source ------------------------------------------------------------------

    def _start_epoch(self) -> None:
        """The sampler told which epoch begins (a DistributedSampler's order depends on it)."""
        set_epoch = getattr(getattr(self.dataloader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)

    def _draw(self) -> None:
        """Queue the prompts of the data source's next batch (lock held); nothing when its
        epochs are all drawn."""
        while not self._exhausted:
            if self._iterator is None:
                self._start_epoch()
                self._iterator = iter(self.dataloader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self._epoch += 1
                self._drawn_in_epoch = 0
                self._exhausted = self._epoch >= self.epochs
                continue
            for item in batch if isinstance(batch, list | tuple) else [batch]:
                name = self._drawn_in_epoch if self.identity is None else self.identity(item)
                key = f"{self._epoch}:{name}"
                if key in self._prompts:
                    raise ValueError(f"RolloutFrontier: the data source gave {key!r} twice in epoch {self._epoch}")
                self._prompts[key] = Prompt(key, item, self._epoch, self._draws, prompt_seed(self.seed, key))
                self._queue.append(key)
                self._drawn_in_epoch += 1
                self._draws += 1
            return
