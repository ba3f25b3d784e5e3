"""python -m decode_worker [flags]: runs the pdq decode worker (flags and PDQ_* env vars; see --help)."""

from pdq.ops.memory import keep_freed_memory

keep_freed_memory()  # before any import starts a thread: one malloc arena for the process (pdq.ops.memory)

from pdq.config import DecodeConfig  # noqa: E402
from pdq.transport.serving import run_service  # noqa: E402
from decode_worker.server import build_server  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    run_service("decode worker", DecodeConfig, build_server, argv)


if __name__ == "__main__":
    main()
