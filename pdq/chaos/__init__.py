"""`pdq chaos`: pdq's own chaos suite. It proves the promise (every accepted request ends exactly
once, whatever dies) on a real cluster while it kills things.

A cluster of separate processes (scheduler, gateway, 2 prefill and 2 decode workers, KV over the
TCP data plane, the built-in model) runs on a durable private Redis (AOF, appendfsync always). A
seeded load of streams, submits with client request ids, retries of the same id, cancels in every
state, deadlines and operator deadline moves goes through the public gRPC API, while a seeded
schedule of faults kills and restarts every role and Redis, drops every Redis connection and
corrupts KV hand-offs. Then a checker reads what the clients saw and what Redis holds and says
whether anything was lost, duplicated, garbled, cancelled or timed out unasked, stalled or leaked.

    pdq chaos                        # the goal run: 5,000 requests, 84 faults (7-20 min on 2 shared cores)
    pdq chaos --short                # the short run `make test` makes (tests/chaos), about a minute
    pdq chaos --short --no-faults    # the same load on a cluster left alone: the harness's own check
    pdq chaos --seed 7 --out DIR     # another seed; DIR/chaos.json, DIR/requests.jsonl, DIR/logs/

Exit status 1 when any check fails; chaos.json has every violation with its evidence.

Modules, one idea each:
  options    the flags and their validated form (the goal run's scale by default, --short)
  plan       the seeded plan: prompts, what each request does, the fault schedule (pure)
  cluster    the processes: spawn, SIGKILL, restart under the same id and ports, health, supervision
  faults     the fault injector: runs the schedule against the cluster
  load       the seeded load through the public API, recording what every call saw
  record     what the load records per request (plain data)
  reference  the fault-free greedy output of each prompt, from the model in this process
  snapshot   what Redis holds after the run (records, output streams, queues, counters, workers)
  check      the checks: pure functions of plan, records, snapshot and reference
  report     the JSON result and the human summary
  command    `pdq chaos`: all of the above, in order; exit status 1 when a check fails
"""
