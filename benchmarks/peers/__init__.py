"""The peers the benchmarks compare meshtron against, where one is more than a few lines."""
