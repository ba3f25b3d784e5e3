"""What a decode worker's step costs in Python: a real `DecodeLoop` over the null model and a
real Redis, in this process, stepped back to back at a few batch sizes.

    python -m pdq.bench.step_cost [--sequences 8,64,256] [--steps 300] [--repeats 5] [--json FILE]

The null model's forward pass picks each row's token and computes nothing (`pdq.model.null`), so
a step's CPU here is the loop's own work around the forward: the engine core's plan and update,
the runner's rows and tensors, sampling, stop checks and detokenizing, the step's Redis command
and the settling of the previous one's reply, and metrics. On a GPU that work runs between
forward passes, so at large batches it decides how close the service comes to the model's
speed. Each sequence is dispatched as the scheduler and a prefill worker would (submitted,
claimed, its prompt prefilled, its first token written, handed over), then the loop steps:
`--repeats` timings of `--steps` steps each, after a warm-up; the report gives the fastest
and the median, in CPU microseconds a step and a sequence (this process's CPU: Redis is a
process of its own, its time not counted).
"""

import argparse
import json
import statistics
import sys
import time
import uuid

from pdq.bench.report import machine

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
WARMUP_STEPS = 50


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def hand_over(store, runner, spec, decode_id: str, prefill_id: str):
    """What the scheduler and a prefill worker do before a decode worker takes a request, in one
    call, for labs and tests that drive a `DecodeLoop` themselves: queues `spec`, claims it for
    `decode_id` (from `prefill_id`), prefills its prompt into a KV entry of its own in `runner`,
    writes its first token and moves it to TRANSFERRING. -> its hand-off (`Arrived`), for the
    loop's `arrive`. RuntimeError where Redis refuses a step of it (a reused request id)."""
    from decode_worker.kv_receive import Arrived
    from pdq.engine.runner import PrefillItem
    from pdq.state.request import State
    from pdq.state.store import StepItem
    from pdq.v1 import internal_pb2 as pb

    rid, prompt = spec.request_id, list(spec.prompt_token_ids)
    if store.submit(spec).kind != "created":
        raise RuntimeError(f"request {rid!r} was not created (its id was used before)")
    (claimed,) = store.claim([(rid, decode_id)], prefill_id)
    key = ("kv-in", rid)
    runner.allocate(key)
    token = int(runner.prefill([PrefillItem(key, prompt, 0)])[0].argmax())
    if store.step([StepItem(rid, claimed.epoch, 0, token, "")]) != [True] or not store.transition(
            rid, claimed.epoch, State.TRANSFERRING):
        raise RuntimeError(f"request {rid!r}: its first token or hand-off was refused")
    return Arrived(pb.KVHeader(spec=spec, epoch=claimed.epoch, generated_token_ids=[token], num_tokens=len(prompt)),
                   key)


class StepLab:
    """A DecodeLoop (not started: stepped here) over the null model, with its store, listener and a
    private Redis; `add(n)` dispatches n sequences that never end (max_tokens far out)."""

    def __init__(self, redis_url: str, capacity: int, max_seq_len: int):
        from decode_worker.loop import DecodeLoop
        from pdq.engine.runner import ModelRunner
        from pdq.model.loader import eos_token_ids, resolve_model
        from pdq.model.tokenizer import load_tokenizer
        from pdq.state import redisconn
        from pdq.state.cancel_listener import CancelListener
        from pdq.state.keys import Keys
        from pdq.state.store import SyncStore

        path = str(resolve_model("null"))
        self.max_seq_len = max_seq_len
        self.runner = ModelRunner.from_pretrained(path, kv_budget_tokens=max_seq_len * (capacity + 1),
                                                  max_seq_len=max_seq_len)
        self.client = redisconn.connect(redis_url)
        self.store = SyncStore(self.client, "pdq", result_ttl_s=600)
        self.cancels = CancelListener(redis_url, Keys("pdq"), 30.0)
        self.loop = DecodeLoop(self.runner, self.store, self.cancels, load_tokenizer(path), eos_token_ids(path),
                               "step-cost", lambda rids: None)

    def add(self, n: int) -> list[str]:
        """-> the request ids, which join the batch at the next step."""
        from pdq.state.store import now_ms
        from pdq.v1 import generation_pb2 as gen_pb
        from pdq.v1 import internal_pb2 as pb

        rids = []
        for _ in range(n):
            rid = uuid.uuid4().hex
            rids.append(rid)
            spec = pb.RequestSpec(request_id=rid, tenant="bench", tier="interactive", prompt_token_ids=PROMPT,
                                  sampling=gen_pb.SamplingParams(max_tokens=self.max_seq_len, ignore_eos=True),
                                  arrival_ms=now_ms())
            self.loop.arrive(hand_over(self.store, self.runner, spec, "decode-step-cost", "prefill-step-cost"))
        return rids

    def cpu_us_per_step(self, steps: int) -> float:
        start = time.process_time()
        for _ in range(steps):
            self.loop._step()
        return (time.process_time() - start) / steps * 1e6

    def close(self) -> None:
        self.loop.settle()
        self.cancels.close()
        self.client.close()


def measure(sizes: list[int], steps: int, repeats: int) -> list[dict]:
    """-> per batch size: the CPU a step took (fastest and median of the repeats), and per sequence."""
    from pdq.ops.redis_server import RedisServer

    out = []
    with RedisServer() as redis:
        for n in sizes:
            # room for every step the run takes, plus the warm-up, in each sequence's KV
            lab = StepLab(redis.url, n, max_seq_len=len(PROMPT) + WARMUP_STEPS + steps * repeats + 16)
            try:
                lab.add(n)
                lab.cpu_us_per_step(WARMUP_STEPS)
                runs = [lab.cpu_us_per_step(steps) for _ in range(repeats)]
                if len(lab.loop.running) != n:
                    raise RuntimeError(f"{n - len(lab.loop.running)} of {n} sequences left the batch mid-run")
            finally:
                lab.close()
            best, median = min(runs), statistics.median(runs)
            out.append({"sequences": n, "steps": steps, "repeats": repeats,
                        "cpu_us_per_step": {"min": round(best, 1), "median": round(median, 1),
                                            "runs": [round(r, 1) for r in runs]},
                        "cpu_us_per_sequence": {"min": round(best / n, 2), "median": round(median / n, 2)}})
            say(f"step_cost: {n} sequences: {best:,.0f} us CPU a step (median {median:,.0f}), "
                f"{best / n:.1f} us a sequence")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdq.bench.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", default="8,64,256", help="batch sizes, comma separated (default 8,64,256)")
    p.add_argument("--steps", type=int, default=300, help="steps per timing (default 300)")
    p.add_argument("--repeats", type=int, default=5, help="timings per batch size (default 5)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sequences.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sequences: integers, comma separated, got {args.sequences!r}")
    if not sizes or min(sizes) < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--sequences, --steps and --repeats must be >= 1")
    results = measure(sizes, args.steps, args.repeats)
    if args.json:
        doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "command": " ".join(["python -m pdq.bench.step_cost", *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "step_cost": results}
        with open(args.json, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
        say(f"step_cost: wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
