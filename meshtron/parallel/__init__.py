"""The device mesh, communication, and parallel layers."""
