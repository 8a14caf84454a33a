"""The engine contract is the Protocol: an engine that implements only its members (here by
handing each one to a TorchEngine it holds) is exported, dumped, loaded and saved DeepSpeed-style
with nothing else asked of it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from helpers import saver_config
from recover_fixtures import SPEC, make_setup, recover_config, step_info, train_step
from safetensors.torch import load_file

import areal_ckpt as ac
from areal_ckpt.engines.contract import Engine
from areal_ckpt.tensors import TensorSpec


class OwnEngine:
    """A new kind of engine: every member of the Engine Protocol, and nothing more."""

    def __init__(self, inner: ac.TorchEngine, steps: int | None) -> None:
        self._inner, self._steps = inner, steps
        self.module = inner.module
        self.optimizer = inner.optimizer
        self.lr_scheduler = inner.lr_scheduler

    config = property(lambda self: self._inner.config)
    generation_config = property(lambda self: self._inner.generation_config)
    architecture = property(lambda self: self._inner.architecture)
    on_accelerator = property(lambda self: self._inner.on_accelerator)
    has_optimizer = property(lambda self: self._inner.has_optimizer)

    def export_specs(self) -> list[TensorSpec]:
        return self._inner.export_specs()

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        return self._inner.gather_round(files)

    def recover_state(self, include_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self._inner.recover_state(include_optimizer)

    def fingerprint(self) -> list[int]:
        return self._inner.fingerprint()

    def step_counter(self) -> int | None:
        return self._steps

    def checkpoint_options(self) -> Any:
        return self._inner.checkpoint_options()

    def recover_template(self, with_optimizer_tensors: bool, stored: Any = None) -> dict[str, torch.Tensor]:
        return self._inner.recover_template(with_optimizer_tensors, stored)

    def validate_recover_state(self, engine_state: dict[str, Any], include_optimizer: bool) -> None:
        self._inner.validate_recover_state(engine_state, include_optimizer)

    def load_recover_state(
        self,
        tensors: dict[str, torch.Tensor],
        engine_state: dict[str, Any],
        include_optimizer: bool,
        strict: bool = True,
    ) -> None:
        self._inner.load_recover_state(tensors, engine_state, include_optimizer, strict)


def test_an_engine_implementing_the_protocol_is_exported_dumped_and_loaded(tmp_path: Path) -> None:
    setup = make_setup()
    engine = OwnEngine(setup.engine, steps=7)
    assert isinstance(engine, Engine)
    train_step(setup, 0)

    saver = ac.Saver(saver_config(tmp_path / "export", freq_steps=1), SPEC)
    saver.save(engine, 0, 0, 0)
    saver.finalize()
    exported = next((tmp_path / "export").rglob("model.safetensors"))
    assert torch.equal(load_file(exported)["lm_head.weight"], setup.model.lm_head.weight.detach())

    handler = ac.RecoverHandler(recover_config(tmp_path / "recover"), SPEC)
    handler.dump(engine, step_info(0), force=True)
    handler.close()
    assert ac.save_checkpoint(engine, tmp_path / "ds")  # the tag comes from step_counter()
    assert (tmp_path / "ds" / "latest").read_text().strip() == "global_step7"

    fresh = make_setup(seed=1)
    restored = OwnEngine(fresh.engine, steps=None)
    handler = ac.RecoverHandler(recover_config(tmp_path / "recover"), SPEC)
    info = handler.load(restored)
    handler.close()
    assert info is not None and info.last_step_info.global_step == 0
    for (name, saved), loaded in zip(setup.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(saved, loaded), name
    assert fresh.optimizer.state_dict()["state"].keys() == setup.optimizer.state_dict()["state"].keys()
    assert ac.load_checkpoint(restored, tmp_path / "ds")[0] == str(tmp_path / "ds" / "global_step7")
