"""Running the suite: a property under a profile, the gate over every property, baselines."""
