"""FSDP2 on Lightning's own engine: `--trainer.strategy fsdp2`.

Every rank holds 1/N of each weight, gradient and optimizer state (ZeRO-3), a DTensor split
by rows across a 1-D mesh of all ranks; each transformer block, and the token embedding when
the head does not share it, gathers its weights for its forward and backward and frees them
after (torchtitan's `apply_fsdp`). Lightning's `ModelParallelStrategy` starts the processes
and calls the LightningModule's `configure_model`, where `shard_model` applies `fully_shard`;
`FSDP2Strategy` adds what gptmini's runs need on top:

- a 1-D mesh over every rank of every node (Lightning's own is (nodes, GPUs per node) for
  tensor parallelism, which gptmini does not use);
- checkpoints saved as a directory of shards (torch.distributed.checkpoint, each rank its
  own file; `gptmini.checkpoint.sharded`) that is either the new one or the previous one,
  never a mix (`replace_directory`);
- resume from such a directory on any number of ranks, or from a single-file checkpoint (an
  unsharded run's, or a consolidated one), optimizer states included, with the settings a
  resumed run changes applied before they load.

FSDP1 (Lightning's `FSDPStrategy`, `--trainer.strategy fsdp`) is refused with the way here:
torch deprecates it for `fully_shard`, Lightning refuses it on a CPU so it never ran in
gptmini's tests, and its flattened parameters cannot give Muon whole matrices.
"""

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from gptmini.checkpoint import read_checkpoint
from gptmini.checkpoint.atomic import (
    atomic_save,
    remove_checkpoint_path,
    remove_stale_temporaries,
    replace_directory,
    temporary_path,
)
from gptmini.checkpoint.sharded import SHARDED_METADATA, is_sharded, read_sharded_metadata

__all__ = ["FSDP1_REFUSED", "FSDP2Strategy", "is_sharded_run", "is_sharded_state",
           "names_by_position", "shard_model"]

FSDP1_REFUSED = (
    "--trainer.strategy {name} is Lightning's FSDPStrategy (FSDP1), which gptmini does not "
    "use: torch deprecates it for FSDP2, Lightning refuses it on a CPU, and Muon cannot "
    "orthogonalize its flattened shards. Use --trainer.strategy fsdp2 (the same sharding, "
    "with fully_shard, on CPUs and GPUs, with Muon and resumable sharded checkpoints)")


def shard_model(model: nn.Module, mesh: DeviceMesh, precision: str, compile: bool) -> None:
    """`fully_shard` `model` (a GPTModel) over `mesh`, in place: each transformer block,
    the token embedding unless the head shares it, then the rest (position embedding, final
    norm, head) as the root's group, which stays gathered from forward to backward.

    bf16-mixed precision gathers the weights in bf16 for compute and reduces gradients in
    float32 (torchtitan's policy); the sharded weights and optimizer states stay float32.
    `compile` compiles each block before it is sharded (torchtitan's order), in place, so
    parameter names do not change.
    """
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "bf16-mixed" else MixedPrecisionPolicy())
    for block in model.trf_blocks:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    if model.out_head.weight is not model.tok_emb.weight:  # tied: one group must hold both
        fully_shard(model.tok_emb, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "hidden_states")  # a chunked lm_loss's pass


def is_sharded_run(model: nn.Module) -> bool:
    """Whether `model`'s weights are FSDP2 shards (`shard_model` ran on it)."""
    return isinstance(model, FSDPModule)


def names_by_position(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name in `module` of each of `optimizer`'s parameters, in the order its param
    groups list them: the position that `Optimizer.state_dict` keys their states by."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` as FSDP2 over every rank, with atomic sharded
    checkpoints and resume across world sizes (see the module's docstring).

    Args:
        **kwargs: ModelParallelStrategy's `process_group_backend` and `timeout`.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(save_distributed_checkpoint=True, **kwargs)
        self.mesh: DeviceMesh | None = None
        """Every rank in one dimension, which `shard_model` shards over (set up with the
        process group)."""

    def setup_environment(self) -> None:
        super().setup_environment()
        self.mesh = init_device_mesh(self.root_device.type, (self.world_size,),
                                     mesh_dim_names=("shard",))

    # --- saving -----------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None
                        ) -> None:
        """Every rank writes its shards into a hidden directory beside `filepath`; rank 0
        adds meta.pt and puts the directory in the place of the previous checkpoint
        (`replace_directory`): a save that fails or is killed leaves the previous one."""
        if storage_options is not None:
            raise TypeError("FSDP2Strategy.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        staging = Path(self.broadcast(str(temporary_path(path))))  # rank 0's name
        shards = {"state_dict": checkpoint.pop("state_dict"),
                  **{f"optimizer_{i}": s
                     for i, s in enumerate(checkpoint.pop("optimizer_states", []))}}
        if self.is_global_zero:  # a killed save's leftovers must not mix into this one
            remove_stale_temporaries(path.parent, path.name)
        self.barrier("sharded checkpoint staged")
        try:
            dcp.save(shards, checkpoint_id=staging)  # collective; any rank's error: all raise
            if self.is_global_zero:
                atomic_save(checkpoint, staging / SHARDED_METADATA)
                replace_directory(staging, path)
        finally:
            self.barrier("sharded checkpoint saved")
            if self.is_global_zero:  # a failed save's leftovers
                remove_checkpoint_path(staging)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            remove_checkpoint_path(Path(filepath))

    # --- resuming -----------------------------------------------------------------------

    @property
    def lightning_restore_optimizer(self) -> bool:
        # Lightning loads the states `load_checkpoint` read after the module's
        # on_load_checkpoint changed their settings (a resumed run's new rates).
        return True

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Load the weights of a sharded directory (on any number of ranks) or of a single
        file into the sharded model; the optimizer states go into the returned checkpoint's
        "optimizer_states", by parameter name, for `load_optimizer_state_dict`."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if is_sharded(path):
            return self._load_sharded(path)
        checkpoint = read_checkpoint(path, "cpu", mmap=True)
        whole = StateDictOptions(full_state_dict=True, strict=self.lightning_module
                                 .strict_loading)
        set_model_state_dict(self.model, checkpoint["state_dict"], options=whole)
        states = checkpoint.get("optimizer_states", [])
        checkpoint["optimizer_states"] = [
            _by_name(state, names_by_position(self.model, optimizer))
            for state, optimizer in zip(states, self.optimizers, strict=False)]
        return checkpoint

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        shards = {"state_dict": get_model_state_dict(self.model),
                  **{f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)
                     for i, optimizer in enumerate(self.optimizers)}}
        dcp.load(shards, checkpoint_id=path)  # resharded to this run's ranks
        set_model_state_dict(self.model, shards.pop("state_dict"), options=StateDictOptions(
            strict=self.lightning_module.strict_loading))
        checkpoint = read_sharded_metadata(path)
        checkpoint["optimizer_states"] = [shards[f"optimizer_{i}"]
                                          for i in range(len(self.optimizers))]
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        whole = not is_sharded_state(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"],
                                    strict=False):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state,
                                     options=StateDictOptions(full_state_dict=whole))


def is_sharded_state(checkpoint: dict) -> bool:
    """Whether a loaded checkpoint's optimizer states are shards (DTensors)."""
    return any(isinstance(v, DTensor) for s in checkpoint.get("optimizer_states", [])
               for entry in s.get("state", {}).values() for v in entry.values())


def _by_name(state: dict, names: list[str]) -> dict:
    """A single file's optimizer state (keyed by position) keyed by parameter name, as
    `set_optimizer_state_dict` reads a whole state."""
    return {"state": {names[i]: entry for i, entry in state.get("state", {}).items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}

