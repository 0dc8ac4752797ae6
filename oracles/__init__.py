"""The oracles: the unsharded model on one device (single_device), and the case's own DP
entry point without TP (plain_ddp); verdicts judges a TP+DP case against each."""
