"""Judging observations: checks, tolerances, verdicts, and the signatures baselines record."""
