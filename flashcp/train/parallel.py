"""Data parallel x context parallel on a DeviceMesh: the mesh, its process groups, and how weights are held.

The mesh is 2-D, ``(dp, cp)`` with dimension names ``("dp", "cp")`` (``build_mesh``). ``init_device_mesh``
lays the world's ranks out row-major, so global rank ``g`` is CP rank ``g % cp`` of replica ``g // cp``: the
ranks of one CP group are consecutive, i.e. on one node when ``cp`` divides the GPUs per node, where the
per-layer K/V exchange of ``cp_attention`` gets the fast links; the gradient reduction crosses nodes once
per step. Each replica reads its own sequences (``CPLoader.from_mesh``); all ranks of a CP group read the
same sequence and keep their own tokens.

Every rank's loss is its share of the *global* batch's loss (sum of token losses over all replicas divided
by the label tokens of all replicas), so the gradient of the global loss is the *sum* of all ranks'
gradients over the flattened ``dp x cp`` mesh (torchtitan's ``dp_shard_cp``). Two ways to hold weights:

- ``fsdp``: FSDP2 ``fully_shard`` of every decoder block and then the root over the flattened mesh; the
  gradients are reduce-scattered in backward with a divide factor of 1 (a sum, not FSDP's default mean).
- ``replicate``: every rank holds all weights and, after backward, one all-reduce (sum) per dtype over the
  flattened group (``flashcp.train.step.all_reduce_gradients``).

Both make exactly the update a single process makes on the whole global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["SHARDING_MODES", "FsdpFn", "ParallelGroups", "build_mesh", "decoder_blocks", "full_parameters",
           "is_sharded", "shard_model"]

SHARDING_MODES = ("fsdp", "replicate")
"""How weights are held across the flattened dp x cp mesh."""

FsdpFn = Callable[[nn.Module, Any], nn.Module]
"""``fsdp(model, flat_mesh) -> model``: a model family's own FSDP2 wrapping over the flattened dp x cp mesh,
gradients summed (e.g. ``flashcp.integrations.torchtitan.shard_titan_model``)."""


def build_mesh(dp: int, cp: int, device_type: str = "cpu"):
    """A ``(dp, cp)`` DeviceMesh named ``("dp", "cp")`` over the whole world (``dp * cp`` ranks).

    The default process group must be initialised with ``dp * cp`` ranks. Raises ValueError otherwise.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp < 1 or cp < 1 or dp * cp != world:
        raise ValueError(f"dp {dp} x cp {cp} must equal the {world} ranks launched; launch dp x cp ranks or "
                         "change --dp")
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ParallelGroups:
    """The process groups one training step uses, taken from a ``(dp, cp)`` mesh once."""

    mesh: Any
    """The 2-D DeviceMesh."""
    flat_mesh: Any
    """The flattened ``dp x cp`` mesh (FSDP2 shards over it)."""
    cp_group: Any
    """This rank's CP group (``cp_attention``'s collectives)."""
    dp_group: Any
    """The ranks holding the same CP rank in every replica (the global label count is summed over it)."""
    grad_group: Any
    """All ranks of the flattened mesh: gradients and the logged loss are summed over it."""
    dp_size: int
    """Data-parallel replicas."""
    cp_size: int
    """Ranks per CP group."""

    @classmethod
    def from_mesh(cls, mesh, dp_dim: str = "dp", cp_dim: str = "cp") -> ParallelGroups:
        """Take the groups of ``mesh``, which must name ``dp_dim`` and ``cp_dim``; flattens them once."""
        names = tuple(mesh.mesh_dim_names or ())
        if dp_dim not in names or cp_dim not in names:
            raise ValueError(f"the device mesh has dimensions {list(names)}, it needs '{dp_dim}' and '{cp_dim}'")
        flat = mesh[dp_dim, cp_dim]._flatten(f"{dp_dim}_{cp_dim}")
        return cls(mesh=mesh, flat_mesh=flat, cp_group=mesh[cp_dim].get_group(), dp_group=mesh[dp_dim].get_group(),
                   grad_group=flat.get_group(), dp_size=mesh[dp_dim].size(), cp_size=mesh[cp_dim].size())


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 wraps one by one.

    A TinyDecoder's ``blocks``, a transformers causal LM's ``model.layers``; ValueError for a model with neither.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        blocks = getattr(getattr(model, "model", None), "layers", None)
    if blocks is None:
        raise ValueError(f"cannot find the decoder blocks of a {type(model).__name__} (no .blocks or "
                         ".model.layers) to shard")
    return list(blocks)


def shard_model(model: nn.Module, groups: ParallelGroups, mode: str, *, fsdp: FsdpFn | None = None) -> nn.Module:
    """Prepare ``model`` (same weights on every rank) for training on ``groups``; returns it.

    ``fsdp`` mode: ``fully_shard`` each decoder block, then the root, over ``groups.flat_mesh``, gradients
    summed (divide factor 1); or, when the ``fsdp`` hook is given, ``fsdp(model, groups.flat_mesh)``, the
    model family's own wrapping over the same mesh (a torchtitan decoder: torchtitan's
    ``apply_fsdp_to_decoder``, ``flashcp.integrations.torchtitan.shard_titan_model``). ``replicate``: the
    model as it is (``train_step`` all-reduces its gradients). Build the optimizer after this call.
    """
    if mode not in SHARDING_MODES:
        raise ValueError(f"unknown sharding mode '{mode}' (choose from {', '.join(SHARDING_MODES)})")
    if mode == "replicate":
        return model
    if fsdp is not None:
        return fsdp(model, groups.flat_mesh)
    from torch.distributed.fsdp import fully_shard

    sharded = [*decoder_blocks(model), model]
    for module in sharded:
        fully_shard(module, mesh=groups.flat_mesh)
    for module in sharded:  # the factor belongs to each module's own parameter group, not to its children
        module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        # plain SUM collectives: a custom factor would otherwise become NCCL's PREMUL_SUM, which gloo lacks
        module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` is FSDP2-sharded (its gradients are reduced in backward)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full, detached tensor (a collective when the model is sharded: call on all ranks)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out
