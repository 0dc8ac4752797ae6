"""Single-process oracles (the unsharded model on one device, plain DDP): see issue 4."""
