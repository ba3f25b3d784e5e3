"""The `pdq` command: run a cluster or one role, call the API, manage the built-in model.

Stdout carries only results (generated text, or JSON with --json); everything else goes to
stderr, so scripts can use the output.
"""

import argparse
import json
import os
import signal
import sys

import grpc

from pdq.model.null import is_null_spec
from pdq.ops import cpu
from pdq.config import DTYPE_NAMES, UP_COLOCATE_HELP, UP_SEPARATE_HELP, UP_CONTROL_POLICY_HELP

DEFAULT_TARGET = "127.0.0.1:50051"
INTERRUPTED = 130  # the exit status after Ctrl-C, as a shell reports a command killed by SIGINT


def _up(args: argparse.Namespace) -> int:
    from pdq.ops.up import Cluster, run

    if args.colocate and args.prefill is not None:
        print("pdq up: --prefill starts prefill-only workers, which only --separate has (colocated workers "
              "prefill themselves); add --separate, or leave --prefill out", file=sys.stderr)
        return 2
    if args.schedulers < 1:
        print(f"pdq up: --schedulers must be at least 1, got {args.schedulers}", file=sys.stderr)
        return 2
    if args.redis_url:
        from pdq.state.redis_url import check_redis_url

        try:
            check_redis_url(args.redis_url)
        except ValueError as exc:
            print(f"pdq up: --redis-url: {exc}", file=sys.stderr)
            return 2
    env = {"PDQ_KV_TRANSPORT": args.kv_transport} if args.kv_transport else {}
    if args.dtype:
        env["PDQ_DTYPE"] = args.dtype
    note = cpu.dtype_note(args.dtype or os.environ.get("PDQ_DTYPE"), cpu.cpu_flags(),
                          gpu=os.path.exists("/dev/nvidia0") or is_null_spec(args.model))
    if note:
        print(note, file=sys.stderr)
    prefill = 1 if args.prefill is None else args.prefill
    return run(Cluster(prefill=prefill, decode=args.decode, schedulers=args.schedulers, model=args.model,
                       redis_url=args.redis_url,
                       port=args.port, durable=args.durable, mtls=args.mtls, colocate=args.colocate,
                       control_policy=args.control_policy, extra_env=env, http_port=args.http_port))


def _generate(args: argparse.Namespace) -> int:
    from pdq.client import Client, finish_name

    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, request_id=args.request_id,
              tier=args.tier, timeout_ms=args.timeout_ms, stream_interval=args.stream_interval,
              min_p=args.min_p, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
              repetition_penalty=args.repetition_penalty, stop_token_ids=args.stop_token_id, logprobs=args.logprobs,
              min_tokens=args.min_tokens, n=args.n)
    with Client(args.target, api_key=args.api_key, tls_ca=args.tls_ca) as client:
        try:
            if args.stream and not args.json and args.n <= 1:  # several choices: printed whole, one by one
                for msg in client.generate_stream(args.prompt, **kw):
                    if msg.text:
                        sys.stdout.write(msg.text)
                        sys.stdout.flush()
                    if msg.finish_reason:
                        print(file=sys.stdout)
                        print(f"[{finish_name(msg.finish_reason)}: {msg.usage.completion_tokens} tokens, "
                              f"ttft {msg.timings.ttft_ms:.0f} ms, total {msg.timings.e2e_ms:.0f} ms]", file=sys.stderr)
                return 0
            result = client.generate(args.prompt, **kw)
        except grpc.RpcError as exc:
            print(f"pdq generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(result.to_json()))
    elif result.choices:
        for i, choice in enumerate(result.choices):
            print(f"[{i}] {choice.text}")
    else:
        print(result.text)
    return 0


def _model_save(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdq.model.builtin import save_builtin

    path = save_builtin(Path(args.dir), size=args.size)
    print(f"saved the built-in {args.size} model to {path}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pdq.bench.command import run

    return run(args)


def _chaos(args: argparse.Namespace) -> int:
    from pdq.chaos.command import run

    return run(args)


ROLES = {"gateway": "gateway", "scheduler": "scheduler", "prefill": "prefill_worker", "decode": "decode_worker"}


def _role(module: str, argv: list[str]) -> int:
    import importlib

    importlib.import_module(f"{module}.__main__").main(argv)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdq", description="pdq: an LLM batching service.")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a whole local cluster (private Redis, all roles) and restart what exits")
    mode = up.add_mutually_exclusive_group()
    mode.add_argument("--colocate", dest="colocate", action="store_true", default=True,
                      help=UP_COLOCATE_HELP + " (the default)")
    mode.add_argument("--separate", dest="colocate", action="store_false", help=UP_SEPARATE_HELP)
    up.add_argument("--prefill", type=int, default=None, help="prefill workers, with --separate (default 1)")
    up.add_argument("--decode", type=int, default=1,
                    help="decode workers (default 1); colocated, each also prefills")
    up.add_argument("--schedulers", type=int, default=1,
                    help="scheduler replicas (default 1): one dispatches under a lease in Redis, the others serve "
                         "submits and take over within a couple of seconds when it dies")
    up.add_argument("--control-policy", choices=cpu.POLICIES, default=os.environ.get("PDQ_UP_CONTROL_POLICY") or "batch",
                    help=UP_CONTROL_POLICY_HELP)
    up.add_argument("--model", default=os.environ.get("PDQ_MODEL", "builtin"),
                    help="builtin (= builtin:small), builtin:tiny, builtin:1b (for a GPU), null[:STEP_MS] (no model "
                         "compute: measures the control plane), or a Hugging Face checkpoint dir")
    up.add_argument("--redis-url", default=os.environ.get("PDQ_UP_REDIS_URL"),
                    help="use this Redis instead of starting a private one")
    up.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                    help="the workers' model dtype (default: bfloat16 on a CPU with bfloat16 matrix instructions, "
                         "AMX or AVX512_BF16 (Intel Xeon 4th generation, AMD Zen 4 and later), where it serves 1.5-2x "
                         "float32's tokens/s; float32 on other CPUs; bfloat16 on a GPU)")
    up.add_argument("--port", type=int, default=50051, help="gateway port (default 50051; 0 = any free)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="port of the gateway's OpenAI-compatible HTTP API (default 8000; 0 = off)")
    up.add_argument("--durable", action="store_true", help="private Redis with AOF, appendfsync always")
    up.add_argument("--mtls", action="store_true",
                    help="mutual TLS between the cluster's roles, with a throwaway CA made for this run (openssl)")
    up.add_argument("--kv-transport", choices=("grpc", "tcp"), default=None,
                    help="how KV caches go from prefill to decode workers: tcp (the decode workers' TCP data "
                         "plane, the default) or grpc (PushKV streaming only)")
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=os.environ.get("PDQ_TARGET", DEFAULT_TARGET), help="gateway host:port")
    gen.add_argument("--api-key", default=None,
                     help="API key (default: $PDQ_API_KEY, else the dev key of a local `pdq up`)")
    gen.add_argument("--tls-ca", default=None, help="CA certificate (PEM) of a TLS gateway (default: $PDQ_TLS_CA)")
    gen.add_argument("--max-tokens", type=int, default=0, help="tokens to generate (0 = server default, 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    gen.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this share of the top one's probability")
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=0.0, help="HF's; 0 = off")
    gen.add_argument("-n", "--n", type=int, default=0, help="completions of the prompt (1..16; with --json all of them)")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="tokens to generate before EOS, a stop token or a stop string may end the output")
    gen.add_argument("--stop-token-id", type=int, action="append", default=[], help="token id that ends the output (repeatable)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="each token's log-probability and the N most likely (with --json)")
    gen.add_argument("--request-id", default="", help="idempotency key")
    gen.add_argument("--tier", default="", help="interactive (default) or batch")
    gen.add_argument("--timeout-ms", type=int, default=0)
    gen.add_argument("--stream-interval", type=int, default=0, metavar="N",
                     help="decode steps per stream message after the first token (1..256; default 1)")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print tokens as they come (default) or all at the end")
    gen.add_argument("--json", action="store_true", help="print one JSON object (id, text, token ids, usage, timings)")
    gen.set_defaults(func=_generate)

    model = sub.add_parser("model", help="the built-in model")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    save = model_sub.add_parser("save", help="write the built-in model as a Hugging Face checkpoint")
    save.add_argument("dir")
    save.add_argument("--size", default="small", help="tiny or small (default)")
    save.set_defaults(func=_model_save)

    from pdq.bench.options import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="measure throughput and latency: strategies, baselines, percentiles, plots",
                           description="Offer a seeded workload to a cluster (--target, or --spawn one per strategy) "
                                       "and to baselines; report tokens/s, TTFT/ITL/e2e percentiles and goodput.")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)

    from pdq.chaos.options import add_arguments as add_chaos_arguments

    chaos = sub.add_parser("chaos", help="pdq's chaos suite: kill every role and Redis under a seeded load, then "
                                         "check that every request ended exactly once",
                           description="Start a cluster of separate processes on a durable private Redis, run a "
                                       "seeded load through the public API while killing and restarting every role "
                                       "and Redis, dropping Redis connections and corrupting KV hand-offs, then "
                                       "check: nothing lost, duplicated, garbled, cancelled or timed out unasked, "
                                       "stalled or leaked; no UNKNOWN/INTERNAL. Exit status 1 when a check fails.")
    add_chaos_arguments(chaos)
    chaos.set_defaults(func=_chaos)

    from pdq.cli.operator import add_parsers as add_operator_parsers

    add_operator_parsers(sub)

    for name, module in ROLES.items():  # listed here; `main` hands their flags to the role itself
        sub.add_parser(name, help=f"run one {module} process (flags: pdq {name} --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Runs one subcommand and exits with its status; Ctrl-C (SIGINT) in any of them ends it with
    one line on stderr and status 130 (128 + SIGINT), its calls cancelled and channels closed
    on the way out."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in ROLES:  # the role parses its own flags (REMAINDER would not take a leading --flag)
            code = _role(ROLES[argv[0]], argv[1:])
        else:
            args = build_parser().parse_args(argv)
            code = args.func(args)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not interrupt the exit
        print("pdq" + (f" {argv[0]}" if argv else "") + ": interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    sys.exit(code)


if __name__ == "__main__":
    main()
