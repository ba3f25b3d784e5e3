"""pdq decode worker: the continuous batch, fed by KV hand-offs from prefill workers."""
