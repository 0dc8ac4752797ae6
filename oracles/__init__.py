"""Single-process oracles: the unsharded model on one device, and plain DDP without TP."""
