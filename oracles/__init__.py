"""Single-process oracles: the unsharded model on one device, and plain DP (the case's entry point) without TP."""
