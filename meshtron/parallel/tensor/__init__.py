"""Tensor and sequence parallelism: counted collectives and the region functions
(:mod:`.collectives`), the parallel layers (:mod:`.layers`), the loss over a split vocabulary
(:mod:`.loss`) and the product every linear layer runs (:mod:`.linear`, :mod:`.weight_grad`)."""
