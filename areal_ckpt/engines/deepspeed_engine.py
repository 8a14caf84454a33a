"""DeepSpeedEngine: a ``deepspeed.initialize`` engine (ZeRO 0-3) seen the way TorchEngine is.

Export (HF): ZeRO 0-2 keep the whole model on every rank, so tensors are written straight from
parameter memory; under ZeRO-3 each parameter is gathered in turn (``GatheredParameters``) and
dropped at once by ranks that do not write it, so no rank ever holds the whole model.

Recovery: we store what DeepSpeed's optimizer actually trains, not its pickled state dict:

- the model: full tensors under ZeRO 0-2 (identical on every rank: DCP writes them once); under
  ZeRO-3 each parameter's partition as a 1-D DTensor over the flattened parameter, so the files
  hold whole parameters (``areal-ckpt export`` can rebuild them) and no gather is needed;
- ZeRO 1-3: this rank's fp32 master partitions and the wrapped optimizer's state tensors, under
  keys that name the rank, plus where each parameter lies in them, hyper-parameters,
  loss-scaler settings and the engine's step counters as JSON. A load into other partitions
  (another number of ranks, ZeRO 1 / 2 against 3) maps each parameter's elements into its own
  (:mod:`~areal_ckpt.engines.zero_optimizer`). ZeRO 0 with a torch optimizer goes through
  TorchEngine.

``deepspeed`` is imported only when one of these engines is made.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh

from areal_ckpt import dist
from areal_ckpt.engines.contract import CheckpointOptions, DeepSpeedLike
from areal_ckpt.engines.experts import expert_prefixes, global_expert_names, renamed
from areal_ckpt.engines.peft_configs import active_adapters, adapter_configs, check_same_adapters
from areal_ckpt.engines.torch_engine import TorchEngine, unwrap_model
from areal_ckpt.engines.zero3 import flat_shard, flat_views, master_layout, scatter_whole, unflattened, whole_templates
from areal_ckpt.engines.zero_optimizer import (
    Piece,
    ZeroLayout,
    allocate_state,
    other_optimizer,
    plan_for,
    refusal,
    reshard_template,
    restore_optimizer,
)
from areal_ckpt.errors import CheckpointError
from areal_ckpt.paths import MODEL_PREFIX, OPTIM_PREFIX
from areal_ckpt.tensors import TensorSpec, local_crc32

_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class DeepSpeedEngine:
    """What the Saver, RecoverHandler and :func:`areal_ckpt.save_checkpoint` need from DeepSpeed.

    ``ds_engine`` is what ``deepspeed.initialize`` returned first. Construction is local;
    ``gather_round`` (ZeRO-3), ``recover_state`` and ``load_recover_state`` are collective.
    """

    def __init__(self, ds_engine: DeepSpeedLike) -> None:
        self.ds_engine = ds_engine
        _refuse_nvme_offload(ds_engine)
        self.stage = int(ds_engine.zero_optimization_stage())
        self.module = unwrap_model(ds_engine.module)
        self.optimizer = ds_engine.optimizer
        self.lr_scheduler = ds_engine.lr_scheduler
        self._torch = TorchEngine(
            self.module, optimizer=self.optimizer if self.stage == 0 else None, lr_scheduler=self.lr_scheduler
        )
        if self.stage == 0 and self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DeepSpeedEngine: ZeRO stage 0 with {type(self.optimizer).__name__} (fp16 / bf16 wrapper) is not "
                "supported; use ZeRO stage 1 or higher for mixed precision"
            )
        self._mesh: DeviceMesh | None = None
        #: A dump of other ZeRO partitions a load approved, then what fills this rank's (see the load).
        self._saved: ZeroLayout | None = None
        self._pieces: list[Piece] | None = None
        self._experts = global_expert_names(self.module)  # expert-parallel MoE (ZeRO 0-2): each rank's own experts

    # -- what export needs ------------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The model's ``PretrainedConfig``; None for a plain ``nn.Module``."""
        return self._torch.config

    @property
    def generation_config(self) -> Any | None:
        """The model's ``GenerationConfig`` when it generates, else None."""
        return self._torch.generation_config

    @property
    def architecture(self) -> str:
        """Class name recorded in ``config.json`` ``architectures``."""
        return self._torch.architecture

    @property
    def on_accelerator(self) -> bool:
        """True when DeepSpeed runs on an accelerator (``auto`` mode then saves asynchronously)."""
        return self.ds_engine.device.type not in ("cpu", "meta")

    @property
    def is_sharded(self) -> bool:
        """True under ZeRO-3: parameters are partitioned and gathering them is collective."""
        return self.stage == 3

    @property
    def has_optimizer(self) -> bool:
        """False when the engine has no optimizer (e.g. a reference model run through DeepSpeed)."""
        return self.optimizer is not None

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.module.named_parameters())

    def export_specs(self) -> list[TensorSpec]:
        """Every exported tensor's name, full shape and dtype (tied duplicates left out); local."""
        if self.stage < 3:
            return self._torch.export_specs()
        parameters = self._parameters()
        specs = []
        for spec in self._torch.export_specs():
            parameter = parameters.get(spec.name)
            ds_shape = getattr(parameter, "ds_shape", None)  # ZeRO-3 keeps the full shape here
            shape = tuple(ds_shape) if ds_shape is not None else spec.shape
            specs.append(TensorSpec(spec.name, shape, spec.dtype))
        return specs

    def gather_round(self, files: Sequence[Sequence[str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)`` for each tensor of ``files[rank]``, in order
        (nothing when ``files`` has no entry for this rank); ``files[i]`` is what rank ``i`` writes.

        Collective under ZeRO-3: every rank passes the same ``files`` and exhausts the iterator;
        each step all-gathers one parameter of every file in turn (DeepSpeed's way) and ranks
        that do not write it drop it at once (a CPU copy: DeepSpeed frees the gathered one).
        Local, and without copies, under ZeRO 0-2 (then on the model's device). CheckpointError
        on every rank for expert-parallel MoE layers, whose experts no rank holds all of (dumps
        and save_checkpoint store every expert).
        """
        if self._experts:
            raise CheckpointError(
                "an HF export of a model with expert-parallel MoE layers is not supported (each rank holds other "
                "experts); save_checkpoint and recovery dumps store every expert"
            )
        if self.stage < 3:
            yield from self._torch.gather_round(files)
            return
        import deepspeed

        me = dist.rank()
        parameters = self._parameters()
        state = self.module.state_dict()
        for names in itertools.zip_longest(*files):
            for owner, name in enumerate(names):
                if name is None:
                    continue
                parameter = parameters.get(name)
                if parameter is None or not hasattr(parameter, "ds_tensor"):
                    full = state[name].detach().cpu() if owner == me else None
                else:
                    with deepspeed.zero.GatheredParameters([parameter]):
                        full = parameter.data.detach().to("cpu", copy=True) if owner == me else None
                if full is not None:
                    yield name, full

    # -- recovery ---------------------------------------------------------------------------

    def step_counter(self) -> int | None:
        """DeepSpeed's ``global_steps``."""
        return int(self.ds_engine.global_steps)

    def checkpoint_options(self) -> CheckpointOptions:
        """The engine's ``checkpoint`` config: ``tag_validation`` (DeepSpeed's default: ``Warn``)
        and ``use_node_local_storage``."""
        if not self.ds_engine.checkpoint_tag_validation_enabled():
            validation = "Ignore"
        else:
            validation = "Fail" if self.ds_engine.checkpoint_tag_validation_fail() else "Warn"
        return CheckpointOptions(validation, bool(self.ds_engine.use_node_local_storage()))

    def recover_state(self, include_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's state for a dump: live tensors (no copies) and the JSON-able rest; local.

        See the module docstring for what is stored; the rest records the ZeRO stage, world
        size and step counters, so a load can check it gets what it expects.
        """
        if self.stage == 0:
            tensors, engine_state = self._torch.recover_state(include_optimizer)
        else:
            tensors, engine_state = self._model_tensors(), {}
            if include_optimizer and self.optimizer is not None:
                engine_state["optimizer_has_state"] = True
                engine_state.update(self._optimizer_state(tensors))
            if self.lr_scheduler is not None:
                engine_state["lr_scheduler"] = self.lr_scheduler.state_dict()
        engine_state["deepspeed"] = {
            "zero_stage": self.stage,
            "world_size": dist.world_size(),
            "counters": {name: int(getattr(self.ds_engine, name)) for name in _COUNTERS},
        }
        if self.stage == 3:
            engine_state["deepspeed"]["flat_shapes"] = {
                name: list(parameter.ds_shape)
                for name, parameter in self._parameters().items()
                if hasattr(parameter, "ds_shape")
            }
        if self.stage > 0 and include_optimizer and self.optimizer is not None:
            engine_state["deepspeed"]["masters"] = master_layout(self.optimizer, self.stage, self.module)
        if (adapters := adapter_configs(self.module)) is not None:
            engine_state["peft"] = adapters
            engine_state["peft_active"] = active_adapters(self.module)
        if self._experts:  # the master layout names local experts: a rebuild from it would mix them
            engine_state["deepspeed"].pop("masters", None)
            engine_state["rank_local_prefixes"] = expert_prefixes(self._experts)
        return renamed(tensors, self._experts), engine_state

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        if self.stage < 3:
            return {MODEL_PREFIX + name: value for name, value in self.module.state_dict().items()}
        parameters = self._parameters()
        tensors = {}
        for name, value in self.module.state_dict().items():
            parameter = parameters.get(name)
            partitioned = parameter is not None and hasattr(parameter, "ds_tensor")
            tensors[MODEL_PREFIX + name] = flat_shard(parameter, self._mesh_of(parameter)) if partitioned else value
        return tensors

    def _mesh_of(self, parameter: Any) -> DeviceMesh:
        """The ranks as a 1-D mesh on the device of ``parameter``'s partition (made once)."""
        if self._mesh is None:
            self._mesh = DeviceMesh(parameter.ds_tensor.device.type, list(range(dist.world_size())))
        return self._mesh

    def _masters(self) -> list[torch.Tensor]:
        optimizer = self.optimizer
        return list(
            optimizer.fp32_partitioned_groups_flat if self.stage == 3 else optimizer.single_partition_of_fp32_groups
        )

    def _optimizer_state(self, tensors: dict[str, torch.Tensor], masters: bool | None = None) -> dict[str, Any]:
        """Add this rank's fp32 master partitions (unless ``masters`` is False; None: unless they
        are stored as the weights, see :meth:`_masters_in_model`) and optimizer state tensors to
        ``tensors``; return the JSON-able rest (hyper-parameters, scalar state, loss scaler)."""
        rank, inner = dist.rank(), self.optimizer.optimizer
        scalars: dict[str, dict[str, Any]] = {}
        in_model = self._masters_in_model()
        for index, master in enumerate(self._masters()):
            if masters or (masters is None and not in_model):
                tensors[f"{OPTIM_PREFIX}rank{rank}.master.{index}"] = master
            scalars[str(index)] = {}
            for key, value in inner.state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{OPTIM_PREFIX}rank{rank}.state.{index}.{key}"] = value
                else:
                    scalars[str(index)][key] = value
        scaler = self.optimizer.loss_scaler
        return {
            "optimizer_class": type(inner).__name__,
            "optimizer_param_groups": [
                {k: v for k, v in group.items() if k != "params"} for group in inner.param_groups
            ],
            "optimizer_scalars": scalars,
            "loss_scaler": {field: getattr(scaler, field) for field in _SCALER_FIELDS if hasattr(scaler, field)},
            "masters_in_model": in_model,
        }

    def _masters_in_model(self) -> bool:
        """True under ZeRO-3 when the parameter partitions are fp32 too: the fp32 masters then
        equal them bit for bit (DeepSpeed copies each step's masters into them), so a dump stores
        the weights once, as DeepSpeed's own checkpoints do, and a load copies them back."""
        return (
            self.stage == 3
            and all(master.dtype == torch.float32 for master in self._masters())
            and all(group.dtype == torch.float32 for group in self.optimizer.fp16_partitioned_groups_flat)
        )

    def recover_template(
        self, with_optimizer_tensors: bool, stored: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
    ) -> dict[str, torch.Tensor]:
        """The live tensors a load fills in place (same keys as :meth:`recover_state`); local.

        With ``with_optimizer_tensors``, state tensors the wrapped optimizer does not have yet
        (it has not stepped) are allocated as ``stored`` (the checkpoint's index) describes them.
        Under ZeRO 0-2, parameters ``stored`` holds flattened (a ZeRO-3 dump) are given as 1-D
        views of the live parameters.
        """
        if self.stage == 0:
            tensors = self._torch.recover_template(with_optimizer_tensors)
        else:
            tensors = self._model_tensors()
            if self.stage == 3 and stored is not None:  # whole tensors of a ZeRO 0-2 dump
                tensors.update(whole_templates(self._parameters(), tensors, stored))
            if with_optimizer_tensors and self.optimizer is not None and self._saved is not None:
                layout = ZeroLayout(master_layout(self.optimizer, self.stage, self.module), self.stage)
                self._pieces = plan_for(self.optimizer, layout, self._masters(), self._saved, stored or {})
                tensors.update(reshard_template(self._pieces, stored or {}, len(self._masters())))
            elif with_optimizer_tensors and self.optimizer is not None:
                allocate_state(self.optimizer.optimizer.state, self._masters(), stored or {})
                self._optimizer_state(tensors, masters=True if stored is not None else None)
                if stored is not None:  # masters stored or not (see _masters_in_model): as the dump did
                    master = f"{OPTIM_PREFIX}rank{dist.rank()}.master."
                    tensors = {k: v for k, v in tensors.items() if not k.startswith(master) or k in stored}
        if self.stage < 3 and stored is not None:
            tensors.update(flat_views(tensors, stored))  # a ZeRO-3 dump holds flattened parameters
        return renamed(tensors, self._experts)

    def validate_recover_state(self, engine_state: dict[str, Any], include_optimizer: bool) -> None:
        """Raise ValueError (saying how to proceed) unless this engine can take the dump: the
        model across every ZeRO stage and world size (the files hold whole parameters); the
        optimizer (of the same class and groups) of ZeRO 0 into 0, of ZeRO 1-3 into 1-3 (other
        partitions mapped by parameter name), on any world size; a PEFT model's adapters of the
        dump's configurations. Local; one outcome on every rank (the same dump, the same model)."""
        saved = engine_state.get("deepspeed")
        if saved is None:
            raise ValueError("not written by a DeepSpeed engine; load it with areal_ckpt.TorchEngine")
        check_same_adapters(engine_state.get("peft"), adapter_configs(self.module))
        stage, world = saved["zero_stage"], saved["world_size"]
        if not include_optimizer:
            return
        module_only = (
            "load the model only (RecoverHandler: recover.no_load_optim; load_checkpoint: load_module_only=True)"
        )
        self._saved, self._pieces = None, None  # nothing of an earlier load that failed half-way
        other = other_optimizer(engine_state, self.optimizer)
        if (stage == 0) != (self.stage == 0):
            other = f"the optimizer state of ZeRO stage {stage} does not fit stage {self.stage}"
        if other is not None:
            raise ValueError(f"{other}; {module_only}")
        if stage == 0 or (world == dist.world_size() and (stage == 3) == (self.stage == 3)):
            return  # the saved partitions are this engine's: read in place
        why = refusal(saved.get("masters"), lambda: master_layout(self.optimizer, self.stage, self.module))
        if why is not None:
            raise ValueError(
                f"the optimizer partitions of ZeRO stage {stage} on {world} ranks cannot be mapped into stage "
                f"{self.stage} on {dist.world_size()} ({why}); {module_only}"
            )
        self._saved = ZeroLayout(saved["masters"], stage)

    def load_recover_state(
        self,
        tensors: dict[str, torch.Tensor],
        engine_state: dict[str, Any],
        include_optimizer: bool,
        strict: bool = True,
    ) -> None:
        """Apply state loaded into the :meth:`recover_template` tensors plus ``engine_state`` (the LR
        scheduler's state when ``engine_state`` holds it). ``strict`` False tolerates model keys that
        were not loaded. Collective under ZeRO-3 (persistent parameters re-gather on next use).
        """
        tensors = renamed(tensors, {global_: local for local, global_ in self._experts.items()})
        saved = engine_state["deepspeed"]
        for name, value in saved.get("counters", {}).items():  # absent: a module-only load
            setattr(self.ds_engine, name, value)
        if self.stage < 3:
            tensors = unflattened(self.module, tensors)
        if self.stage == 0:
            self._torch.load_recover_state(tensors, engine_state, include_optimizer, strict)
            return
        if self.stage < 3:
            model_state = {k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
            if not self._torch.is_own_memory(model_state):
                self.module.load_state_dict(model_state, strict=strict)
        if include_optimizer and self.optimizer is not None:
            restore_optimizer(self.optimizer, self._masters(), tensors, engine_state, self._pieces)
            self._pieces, self._saved = None, None
        elif self.optimizer is not None and self.stage < 3:
            self.optimizer.refresh_fp32_params()  # masters from the loaded weights (module only)
        if self.stage == 3:
            scatter_whole(self._parameters(), tensors)
            if not include_optimizer and self.optimizer is not None:
                self.optimizer._restore_from_bit16_weights()  # masters from the loaded weights (module only)
            persistent = getattr(self.optimizer, "persistent_parameters", [])
            if persistent:
                persistent[0].partition(persistent)
        if self.lr_scheduler is not None and "lr_scheduler" in engine_state:
            self.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])

    def fingerprint(self) -> list[int]:
        """CRC-32 of each of this rank's weight tensors (partitions under ZeRO-3); local."""
        if self.stage < 3:
            return self._torch.fingerprint()
        return [local_crc32(getattr(parameter, "ds_tensor", parameter)) for parameter in self.module.parameters()]


def _refuse_nvme_offload(ds_engine: DeepSpeedLike) -> None:
    """CheckpointError when optimizer state or parameters are offloaded to NVMe: they then live
    in DeepSpeed's swap files, not in the tensors a dump reads, so a checkpoint of them would
    hold whatever the swapped-out buffers hold. Every rank raises it, before anything is read."""
    for what, config in (
        ("offload_optimizer", ds_engine.zero_offload_optimizer()),
        ("offload_param", ds_engine.zero_offload_param()),
    ):
        if config is not None and str(getattr(config.device, "value", config.device)) == "nvme":
            raise CheckpointError(
                f"DeepSpeed zero_optimization.{what}.device is nvme: the state lives in DeepSpeed's swap files, which "
                "areal_ckpt does not read, so it refuses to save or load it (nothing was written). Offload to cpu "
                "instead"
            )
