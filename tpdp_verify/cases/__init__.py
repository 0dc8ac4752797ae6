"""What a run is: plain, printable, picklable data (no torch.distributed, no hypothesis)."""
