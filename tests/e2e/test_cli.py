"""`pdq up` and `pdq generate` as a new user runs them: real processes, Ctrl-C cleans up."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pdq.ops.devkeys import find_dev_key
from pdq.ops.redis_server import free_port

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


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def up(tmp_path, request):
    """`pdq up` on a free port (plus the flags of an indirect parameter), its stderr (and its
    children's logs) in a file: -> (process, port, that file)."""
    port, http_port = free_port(), free_port()
    log = tmp_path / "up.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([*PDQ, "up", "--port", str(port), "--http-port", str(http_port),
                                 *getattr(request, "param", [])], stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()  # printed once every role is healthy
    assert line.strip() == f"gateway: 127.0.0.1:{port}", log.read_text()[-3000:]
    yield proc, port, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def gone(pids: set[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.05)
    return not [p for p in pids if Path(f"/proc/{p}").exists()]


def child_running(parent: int, module: str) -> int:
    """The pid of the `python -m module` process under `parent`, once it has exec'd."""
    for pid in children_of(parent):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv and b"pdq.ops.child" not in argv:
            return pid
    return 0


def wait_for(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("up", [[], ["--separate"]], indirect=True, ids=["default-colocated", "separate"])
def test_up_generate_and_ctrl_c_leaves_nothing_behind(up):
    proc, port, log = up
    separate = " prefill, " in log.read_text().split("cluster healthy", 1)[1].split("\n", 1)[0]
    assert separate == (proc.args[-1] == "--separate")  # colocated unless told
    target = f"127.0.0.1:{port}"
    streamed = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--max-tokens", "8", "--ignore-eos"],
                              capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() and "[length: 8 tokens" in streamed.stderr  # text on stdout, the rest on stderr
    as_json = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--max-tokens", "8", "--ignore-eos",
                              "--json", "--logprobs", "2"], capture_output=True, text=True, timeout=60)
    result = json.loads(as_json.stdout)
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
    assert [lp["token_id"] for lp in result["logprobs"]] == result["token_ids"]
    assert all(len(lp["top"]) == 2 and lp["top"][0]["token_id"] == lp["token_id"] for lp in result["logprobs"])
    assert result["usage"] == {"prompt_tokens": result["usage"]["prompt_tokens"], "completion_tokens": 8}
    assert streamed.stdout.rstrip("\n") == result["text"]  # greedy: the same text either way
    base = log.read_text().split("OpenAI-compatible API: ", 1)[1].split()[0]
    body = json.dumps({"model": "builtin", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(base + "/completions", data=body.encode(), headers={
        "Authorization": f"Bearer {find_dev_key(target)}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:  # the HTTP door: the same greedy text
        assert json.loads(resp.read())["choices"][0]["text"] == result["text"]
    bad = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--temperature", "-2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == "" and "INVALID_ARGUMENT: sampling.temperature" in bad.stderr

    family = children_of(proc.pid)
    roles = {m for pid in family for m in ("scheduler", "prefill_worker", "decode_worker", "gateway")
             if m in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")}
    assert roles == {"scheduler", "decode_worker", "gateway"} | ({"prefill_worker"} if separate else set())
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert gone(family)
    assert port_is_free(port)
    assert nothing_listens(int(base.rsplit(":", 1)[1].split("/")[0]))  # (its served connection may be in TIME_WAIT)
    assert "Traceback" not in log.read_text()


def test_up_refuses_prefill_workers_without_separate():
    out = subprocess.run([*PDQ, "up", "--prefill", "2", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "add --separate" in out.stderr and out.stdout == ""


def test_gateway_never_imports_torch():
    code = ("import sys; import gateway.server, pdq.client, pdq.state.store, pdq.model.tokenizer, pdq.model.loader; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.stdout.strip() == "False", out.stderr


def test_up_restarts_a_killed_worker_keeps_serving_and_ctrl_c_still_stops_everything(up):
    proc, port, log = up
    target = f"127.0.0.1:{port}"
    decode = wait_for("the decode worker", lambda: child_running(proc.pid, "decode_worker"))
    os.kill(decode, signal.SIGKILL)
    wait_for("the restart", lambda: "pdq up: decode-0 restarted" in log.read_text())
    assert "pdq up: decode-0 exited with code -9; restarting in 0.5 s (restart 1)" in log.read_text()
    restarted = wait_for("the new decode worker", lambda: child_running(proc.pid, "decode_worker"))
    assert restarted != decode
    out = subprocess.run([*PDQ, "generate", "Hello", "--target", target, "--max-tokens", "8", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and len(json.loads(out.stdout)["token_ids"]) == 8, out.stderr  # served by the new one

    family = children_of(proc.pid)
    assert restarted in family
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert gone(family) and port_is_free(port)
    text = log.read_text()
    assert "Traceback" not in text
    assert text.count("pdq up: decode-0 restarted") == 1 and text.count(" restarted (pid ") == 1  # none while stopping


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_while_up_starts_stops_what_started_with_status_128_plus_the_signal(tmp_path, sig):
    log = tmp_path / "up.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([*PDQ, "up", "--port", str(free_port())], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        wait_for("a worker process", lambda: child_running(proc.pid, "decode_worker"))  # started, not yet healthy
        family = children_of(proc.pid)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert gone(family)
    text = log.read_text()
    assert "Traceback" not in text and "pdq up: interrupted while starting; stopped" in text
    assert proc.stdout.read() == ""  # it never said it was up


@pytest.mark.parametrize("mode", ["--stream", "--no-stream"])
def test_ctrl_c_mid_generation_cancels_the_request_and_exits_130_with_one_line(up, mode):
    from pdq.client import Client, OperatorClient

    proc, port, _ = up
    target = f"127.0.0.1:{port}"
    key = f"cli-ctrl-c-{mode.strip('-')}-{os.getpid()}"
    gen = subprocess.Popen([*PDQ, "generate", "Count to a million", "--target", target, "--max-tokens", "1500",
                            "--ignore-eos", "--request-id", key, mode],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with Client(target) as client:
            if mode == "--stream":
                assert gen.stdout.read(1)  # tokens are arriving
            else:  # nothing is printed before the end: wait until it decodes
                wait_for("the request decoding", lambda: _state(client, key) == "DECODING")
            gen.send_signal(signal.SIGINT)
            out, err = gen.communicate(timeout=30)
            assert gen.returncode == 130, err
            assert err.splitlines() == ["pdq generate: interrupted"]  # one line, no traceback
            done = client.get_result(key, wait_ms=30_000)
        assert done.done and done.state == "CANCELLED", done
        with OperatorClient(target) as op:
            assert op.get_request(done.request_id).state == "CANCELLED"
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()


def _state(client, key: str) -> str:
    import grpc

    try:
        return client.get_result(key).state
    except grpc.RpcError as exc:  # not submitted yet
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return ""
