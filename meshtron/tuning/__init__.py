"""The tuner: a cost model of time and memory, the layout search and its trial runs."""
