"""Parallelism by concern: the mesh and runtime (:mod:`.mesh`), tensor-parallel layers and
their collectives (:mod:`.tensor`), expert dispatch (:mod:`.experts`) and pipelines
(:mod:`.pipeline`)."""
