"""python -m decode_worker [flags]: runs the pdq decode worker (flags and PDQ_* env vars; see --help)."""

from pdq.config import DecodeConfig
from pdq.serving import run_service
from decode_worker.server import build_server


def main(argv: list[str] | None = None) -> None:
    run_service("decode worker", DecodeConfig, build_server, argv)


if __name__ == "__main__":
    main()
