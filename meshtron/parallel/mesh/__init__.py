"""The device mesh and the process runtime: rank arithmetic (:mod:`.layout`), this rank's
process groups (:mod:`.groups`), each parameter's place in the global model (:mod:`.params`),
joining and leaving the job (:mod:`.process`) and local launching (:mod:`.launch`)."""

from meshtron.parallel.mesh.groups import CommStats, Group, ParallelMesh
from meshtron.parallel.mesh.layout import MeshLayout

__all__ = ["CommStats", "Group", "MeshLayout", "ParallelMesh"]
