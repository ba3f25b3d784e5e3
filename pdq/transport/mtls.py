"""Mutual TLS between pdq's own roles (gateway -> scheduler -> workers, prefill -> decode).

Off unless `--internal-ca/--internal-cert/--internal-key` (or `PDQ_INTERNAL_*`) are set on every
role. Then each internal server asks for a client certificate signed by that CA, and each
internal channel presents its own and checks the server's against the same CA. Channels verify
the name `--internal-tls-name` (default `pdq-internal`) instead of the dialled address, so one
certificate with that name as a subjectAltName serves a role on any host or IP. The gateway's
public port is not affected (it has `--tls-cert/--tls-key` for clients).

`dev_certificates(dir)` makes a throwaway CA and one certificate for `pdq up --mtls` (openssl).
"""

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

DEFAULT_NAME = "pdq-internal"


@dataclass(frozen=True)
class InternalTLS:
    ca: bytes
    cert: bytes
    key: bytes
    name: str = DEFAULT_NAME

    @classmethod
    def from_config(cls, config: Any) -> "InternalTLS | None":
        """None when the config sets no internal CA (plaintext between roles); the config has
        checked that the three files go together."""
        if not config.internal_ca:
            return None
        ca, cert, key = (Path(p).read_bytes() for p in (config.internal_ca, config.internal_cert, config.internal_key))
        return cls(ca, cert, key, config.internal_tls_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.name)]


def aio_channel(address: str, tls: InternalTLS | None, options: list, **kwargs: Any) -> grpc.aio.Channel:
    """An internal grpc.aio channel: mutual TLS when `tls` is set, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, **kwargs)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options + tls.options(), **kwargs)


def sync_channel(address: str, tls: InternalTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.options())


def dev_certificates(directory: Path, name: str = DEFAULT_NAME) -> tuple[Path, Path, Path]:
    """A new CA and one certificate (server and client use, subjectAltName `name`) signed by it,
    in `directory`: -> (ca.pem, cert.pem, key.pem). For local clusters and tests only."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca-key.pem"
    cert, key, csr, ext = (directory / n for n in ("cert.pem", "key.pem", "cert.csr", "cert.ext"))

    def openssl(*args: str) -> None:
        try:
            subprocess.run(["openssl", *args], check=True, capture_output=True)
        except FileNotFoundError:
            raise RuntimeError("`openssl` is needed to make dev certificates; install it or pass your own "
                               "--internal-ca/--internal-cert/--internal-key") from None

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj", "/CN=pdq dev internal CA",
            "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    ext.write_text(f"subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "30",
            "-extfile", str(ext), "-out", str(cert))
    for p in (key, ca_key):
        p.chmod(0o600)
    return ca, cert, key
