"""``lagom bench simulated``: the simulated comparison of lagom with static baselines and AutoCCL."""
