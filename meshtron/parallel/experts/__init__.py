"""Expert parallelism: token dispatch over the ep group (:mod:`.dispatch`) and grouped
expert matmuls (:mod:`.grouped`)."""
