"""python -m prefill_worker [flags]: runs the pdq prefill worker (flags and PDQ_* env vars; see --help)."""

from pdq.ops.memory import keep_freed_memory

keep_freed_memory()  # before any import starts a thread: one malloc arena for the process (pdq.ops.memory)

from pdq.config import PrefillConfig  # noqa: E402
from pdq.transport.serving import run_service  # noqa: E402
from prefill_worker.server import build_server  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    run_service("prefill worker", PrefillConfig, build_server, argv)


if __name__ == "__main__":
    main()
