"""Lightning strategies we extend: DeepSpeed ZeRO that also runs on CPU processes (gloo).

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA, and on CPU it hands DeepSpeed a
device index of None. DeepSpeed itself trains on CPU with gloo, so `HeadsDeepSpeedStrategy`
lifts those checks when the accelerator is the CPU: the CPU test suite then runs ZeRO-2 and
ZeRO-3 through exactly the code path a GPU job uses. On GPUs it behaves as Lightning's own.
"""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Any

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy


class HeadsDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO for head training; `config` is a DeepSpeed config dict
    (conf/deepspeed/*.yaml). `zero_extra` is merged into its `zero_optimization` block."""

    strategy_name = "hydra_heads_deepspeed"

    def __init__(
        self,
        *args: Any,
        zero_extra: dict | None = None,
        micro_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.config, dict):
            if zero_extra:
                self.config.setdefault("zero_optimization", {}).update(dict(zero_extra))
            if micro_batch_size is not None:  # Lightning cannot read it off a batch sampler
                self.config.setdefault("train_micro_batch_size_per_gpu", int(micro_batch_size))

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        if not self._on_cpu:
            return super().setup_environment()
        # Must be set before DeepSpeed first picks its accelerator: on a host that has a GPU it
        # would otherwise move the model there behind Lightning's back.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()  # CPU devices have no index to validate
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _get_process_group_backend(self) -> str:
        return "gloo" if self._on_cpu else super()._get_process_group_backend()

    def _init_deepspeed_distributed(self) -> None:
        if self._on_cpu:
            # DeepSpeed JIT-compiles a shared-memory all-reduce op (~100 s, needs g++) whenever
            # its comm backend starts on CPU; only inference all-reduce uses it, never ZeRO.
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        super()._init_deepspeed_distributed()

    def _device_rank(self) -> int:
        idx = self.root_device.index
        return self.local_rank if idx is None else idx

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        engine, ds_opt, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_opt

    def _initialize_deepspeed_inference(self, model) -> None:
        if not self._on_cpu:
            return super()._initialize_deepspeed_inference(model)
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        cfg.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage_3:
            cfg.update(
                zero_allow_untested_optimizer=self.config["zero_allow_untested_optimizer"],
                zero_optimization=self.config["zero_optimization"],
            )
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=cfg,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )


def gathered(params):
    """Context in which ZeRO-3 partitioned `params` are whole on every rank (a collective: call
    it on every rank). A no-op for ordinary tensors."""
    import contextlib

    params = [p for p in params if hasattr(p, "ds_numel")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def param_share(module) -> dict:
    """How much of `module`'s parameters this rank holds: all of them, or its ZeRO-3 shard."""
    total = local = 0
    for p in module.parameters():
        total += int(getattr(p, "ds_numel", p.numel()))
        local += int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel()
    return {"local": local, "total": total, "fraction": local / total if total else 1.0}
