"""Regenerates the checked-in Python stubs in `pdq/v1/` from `protos/`.

    python -m pdq.ops.protogen          # rewrite the stubs
    python -m pdq.ops.protogen --check  # exit 1 when the checked-in stubs are stale

Other languages compile the same sources with `protoc -Iprotos protos/pdq/v1/*.proto`.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
STUBS = ROOT / "pdq" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs of every proto under protos/pdq/v1 into out_dir/pdq/v1."""
    from grpc_tools import protoc
    import grpc_tools

    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "pdq" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted(p for p in (out_dir / "pdq" / "v1").iterdir() if p.name.endswith(SUFFIXES))


def stale_files() -> list[str]:
    """Names of stubs that differ from what protoc generates now (missing or extra included)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    current = {p.name: p.read_bytes() for p in STUBS.iterdir() if p.name.endswith(SUFFIXES)}
    return sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale stubs (run `python -m pdq.ops.protogen`): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
