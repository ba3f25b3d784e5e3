"""The checked-in stubs match protos/, and protos/ compiles with plain protoc includes."""

import subprocess
import sys
from pathlib import Path

from pdq.ops import protogen

ROOT = Path(__file__).resolve().parent.parent


def test_checked_in_stubs_are_fresh():
    assert protogen.stale_files() == [], "run `python -m pdq.ops.protogen` and commit the stubs"


def test_protos_compile_with_plain_include_path(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--descriptor_set_out={tmp_path}/d.pb",
                           *protos], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_rpc_and_field_is_documented():
    """Each rpc and each message field has a // comment on the line(s) above it."""
    undocumented = []
    for path in (ROOT / "protos").rglob("*.proto"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = (s.endswith(";") and "=" in s and not s.startswith(("option", "syntax", "//"))
                        and not s.split()[0].isupper())
            if (s.startswith("rpc ") or is_field) and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{path.name}:{i + 1}: {s}")
    assert undocumented == []
