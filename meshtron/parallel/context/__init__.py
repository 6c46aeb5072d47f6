"""Context parallelism: the load-balanced split of sequences over cp, positions and document
masks (:mod:`.sequence`), the attention core (:mod:`.core`), and three ways attention sees the
whole sequence (:mod:`.attention` picks): ring attention passing keys and values
(:mod:`.ring`), all-to-all over heads (:mod:`.ulysses`) and all-gathered keys and values
(:mod:`.allgather`)."""
