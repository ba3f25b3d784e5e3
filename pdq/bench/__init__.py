"""`pdq bench`: seeded workloads offered to a cluster (or a baseline), measured from the client.

- `workload`: the requests (exact prompt and output lengths, as token ids) and their tenants;
- `arrivals`: when requests are offered (all at once, closed loop, Poisson) and rate sweeps;
- `record`: what one run produced, request by request (timestamps of every token);
- `service`: drives a running cluster over gRPC streaming, with threads;
- `baselines`: the same requests through the in-process `LLMEngine` and naive HF `generate()`;
- `metrics`: percentiles, throughput, goodput under an SLO, per-tenant share;
- `report`, `plot`: the terminal table, ratios, `--json` and `--plot`;
- `options`, `command`: the CLI.
"""
