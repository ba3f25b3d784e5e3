"""Operations: `pdq up`'s local cluster, process supervision, child processes, private Redis and Sentinel
groups, dev keys, CPU and memory tuning, fault hooks, the generated docs and stubs."""
