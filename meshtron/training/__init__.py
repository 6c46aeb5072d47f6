"""The training loop and what it reports: metrics, progress, evaluation, plots."""
