"""`pdq up` and `pdq generate` as a new user runs them: real processes, Ctrl-C cleans up."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdq.redis_server import free_port

PDQ = [sys.executable, "-m", "pdq.cli"]


def children_of(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            child = int(stat.parent.name)
            out |= {child} | children_of(child)
    return out


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def up():
    port = free_port()
    proc = subprocess.Popen([*PDQ, "up", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # printed once every role is healthy
    assert line.strip() == f"gateway: 127.0.0.1:{port}", proc.stderr.read() if proc.poll() is not None else line
    yield proc, port
    if proc.poll() is None:
        proc.kill()


def test_up_generate_and_ctrl_c_leaves_nothing_behind(up):
    proc, port = up
    target = f"127.0.0.1:{port}"
    streamed = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--max-tokens", "8", "--ignore-eos"],
                              capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() and "[length: 8 tokens" in streamed.stderr  # text on stdout, the rest on stderr
    as_json = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--max-tokens", "8", "--ignore-eos",
                              "--json"], capture_output=True, text=True, timeout=60)
    result = json.loads(as_json.stdout)
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": result["usage"]["prompt_tokens"], "completion_tokens": 8}
    assert streamed.stdout.rstrip("\n") == result["text"]  # greedy: the same text either way
    bad = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--temperature", "-2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == "" and "INVALID_ARGUMENT: sampling.temperature" in bad.stderr

    family = children_of(proc.pid)
    assert len(family) >= 5  # redis, scheduler, prefill, decode, gateway
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in family):
        time.sleep(0.05)
    assert not [p for p in family if Path(f"/proc/{p}").exists()]
    assert port_is_free(port)


def test_gateway_never_imports_torch():
    code = ("import sys; import gateway.server, pdq.client, pdq.store, pdq.model.tokenizer, pdq.model.loader; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.stdout.strip() == "False", out.stderr
