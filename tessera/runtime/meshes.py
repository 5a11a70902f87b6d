"""The device meshes of a grid Plan: (pp, dp, tp|sp) row-major, built on first use."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.plan import Plan


class Meshes:
    """The mesh with axes ("dp",), ("dp", "tp") or ("dp", "sp"), "pp" first under pipelining, and
    the 1-D mesh over which gradients are averaged. With expert parallelism "dp" is split into
    ("dp_rep", "ep") and flattened back as "dp". Created lazily: a layout that needs no mesh
    (Plan.replicas) never makes one."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self._mesh: DeviceMesh | None = None
        self._grad: DeviceMesh | None = None
        self._inside: dist.ProcessGroup | None = None
        self._flat: dict[str, DeviceMesh] = {}  # axes made by flattening others (torch wants them kept here)

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            shape, names = self.plan.mesh_shape()
            self._mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
            if self.plan.ep > 1:  # the data-parallel ranks are (replicas of an expert) × (ep): "dp" spans both
                self._flat["dp"] = self._mesh["dp_rep", "ep"]._flatten("dp")
        return self._mesh

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D mesh of axis ``name`` (an axis of the mesh, or one flattened from several)."""
        mesh = self.mesh
        return self._flat[name] if name in self._flat else mesh[name]

    @property
    def grad(self) -> DeviceMesh:
        """``dp``, or dp × sp flattened with Ulysses (sp ranks see different tokens of the same samples)."""
        if self.plan.ulysses_size == 1:
            return self.axis("dp")
        if self._grad is None:
            self._grad = self.mesh["dp", "sp"]._flatten("dp_sp")
        return self._grad

    @property
    def every_step(self) -> bool:
        """Whether gradients are averaged across Plan.groups at every step (sync: every_step)."""
        return self.plan.groups is not None and self.plan.groups.sync == "every_step"

    @property
    def across(self) -> dist.ProcessGroup | None:
        """The ranks at this rank's place in every group, when gradients cross groups every step (DDP's
        hierarchical hook reduces over it); None otherwise."""
        return self.mesh.get_group("group") if self.every_step else None

    @property
    def sharding(self) -> DeviceMesh:
        """The mesh the data-parallel wrapper spreads over: ``grad``, or with every-step groups and FSDP
        the 2-D (group, dp) mesh (HSDP: sharded inside a group, replicated across). DDP keeps ``grad``
        and crosses groups in its hook (``across``)."""
        if self.every_step and self.plan.zero >= 2:
            return self.mesh["group", "dp"]
        return self.grad

    @property
    def inside(self) -> dist.ProcessGroup:
        """Every rank of this rank's group of Plan.groups (each group writes its own checkpoint)."""
        if self._inside is None:
            names = tuple(n for n in self.plan.mesh_shape()[1] if n != "group")
            inner = self.mesh[names] if len(names) > 1 else self.mesh[names[0]]
            self._inside = (inner._flatten("inside") if len(names) > 1 else inner).get_group()
        return self._inside

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.axis(axis).get_group()

    def grad_ranks(self) -> list[int]:
        """The global ranks of this rank's gradient group."""
        return dist.get_process_group_ranks(self.grad.get_group())
