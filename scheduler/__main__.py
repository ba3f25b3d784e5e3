"""python -m scheduler [flags]: runs the pdq scheduler (flags and PDQ_* env vars; see --help)."""

from pdq.config import SchedulerConfig
from pdq.transport.serving import run_service
from scheduler.server import build_server


def main(argv: list[str] | None = None) -> None:
    run_service("scheduler", SchedulerConfig, build_server, argv)


if __name__ == "__main__":
    main()
