"""The Node.js example (examples/node) against a real cluster: Generate, GenerateStream and
Cancel from another language, with the proto loaded at run time."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import KEYS

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"
PROMPT = "Hello from Node.js"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def node_example():
    """examples/node with its dependencies installed (`npm ci` when node_modules is missing)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"the Node.js example needs node and npm on PATH (node: {node}, npm: {npm})")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js" / "package.json").exists():
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                              text=True, timeout=180)
        assert proc.returncode == 0, f"npm ci failed in {NODE_DIR}:\n{proc.stdout}\n{proc.stderr}"
    return node


def sections(stdout: str) -> dict[str, list[str]]:
    """`== Name` headers -> the lines under them."""
    out: dict[str, list[str]] = {}
    current = out.setdefault("", [])
    for line in stdout.splitlines():
        if line.startswith("== "):
            current = out.setdefault(line[3:].strip(), [])
        else:
            current.append(line)
    return out


def tokens(lines: list[str]) -> list[tuple[int, int, str]]:
    """`token <index> <token id> <json text>` lines -> (index, token id, text)."""
    found = []
    for line in lines:
        m = re.fullmatch(r"token (\d+) (\d+) (.*)", line)
        if m:
            found.append((int(m[1]), int(m[2]), json.loads(m[3])))
    return found


def test_node_client_generates_streams_and_cancels(cluster, client, node_example):
    env = {k: v for k, v in os.environ.items() if k != "PDQ_TLS_CA"}
    env.update(PDQ_TARGET=cluster.target, PDQ_API_KEY=KEYS["acme"], PDQ_MAX_TOKENS=str(MAX_TOKENS))
    proc = subprocess.run([node_example, "client.js", PROMPT], cwd=NODE_DIR, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"node client.js failed:\n{proc.stdout}\n{proc.stderr}"
    out = sections(proc.stdout)
    assert {"Generate", "GenerateStream", "Cancel"} <= out.keys(), proc.stdout

    # The same greedy completion as the Python client gets.
    expected = client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    text_line = next(line for line in out["Generate"] if line.startswith("text "))
    assert json.loads(text_line.removeprefix("text ")) == expected.text != ""
    assert (f"finish_reason FINISH_REASON_LENGTH prompt_tokens {expected.prompt_tokens} "
            f"completion_tokens {MAX_TOKENS}") in "\n".join(out["Generate"])

    streamed = tokens(out["GenerateStream"])
    assert [i for i, _, _ in streamed] == list(range(MAX_TOKENS))
    assert [t for _, t, _ in streamed] == expected.token_ids
    assert "".join(x for _, _, x in streamed) == expected.text
    assert f"finish_reason FINISH_REASON_LENGTH completion_tokens {MAX_TOKENS}" in out["GenerateStream"]
    assert "stream status OK" in out["GenerateStream"]

    cancel = out["Cancel"]
    cancelled_id = next(line.split()[1] for line in cancel if line.startswith("cancelling "))
    assert "cancel state CANCELLED" in cancel
    assert any(line.startswith("stream status CANCELLED") for line in cancel), cancel
    assert len(tokens(cancel)) < 1000
    assert client.get_result(cancelled_id, wait_ms=5_000).state == "CANCELLED"
