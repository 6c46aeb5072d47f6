"""``meshtron archsearch``: the model shape for a compute budget, from a scaling law given or
fitted to real proxy runs, priced on a cluster by the cost model."""
