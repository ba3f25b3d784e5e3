"""python -m gateway [flags]: runs the pdq gateway (flags and PDQ_* env vars; see --help)."""

from pdq.config import GatewayConfig
from pdq.transport.serving import run_service
from gateway.server import build_server


def main(argv: list[str] | None = None) -> None:
    run_service("gateway", GatewayConfig, build_server, argv)


if __name__ == "__main__":
    main()
