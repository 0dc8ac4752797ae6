"""The rank side: the pool of ranks, and what runs in a rank (the training loop every run
shares, the DP entry points, a TP+DP case, a checkpoint), each value cut into its Piece."""
