"""`domainpar bench ...`: benchmarks that write JSON; medians and ratios measured
side by side in one run (these machines are shared and noisy)."""
