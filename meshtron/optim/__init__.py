"""Optimizers, learning-rate schedules and gradient clipping."""
