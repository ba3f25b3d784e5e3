"""python -m prefill_worker [flags]: runs the pdq prefill worker (flags and PDQ_* env vars; see --help)."""

from pdq.config import PrefillConfig
from pdq.serving import run_service
from prefill_worker.server import build_server


def main(argv: list[str] | None = None) -> None:
    run_service("prefill worker", PrefillConfig, build_server, argv)


if __name__ == "__main__":
    main()
