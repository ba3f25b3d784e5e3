"""ensure_builtin: one checkpoint per cache dir, even when processes race to build it."""

import hashlib
import multiprocessing as mp

from pdq.model import ensure_builtin, resolve_model

N_PROCS = 4


def file_hashes(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _race(cache_dir, barrier, results):
    barrier.wait()
    path = ensure_builtin("tiny", cache_dir)
    results.put((str(path), file_hashes(path)))


def test_concurrent_processes_build_one_checkpoint(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(N_PROCS), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path, barrier, results)) for _ in range(N_PROCS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len({path for path, _ in got}) == 1
    assert all(hashes == got[0][1] for _, hashes in got)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(got[0][1])
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == ["builtin-tiny-v1"]


def test_cached_checkpoint_is_reused_and_found_through_the_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PDQ_CACHE_DIR", str(tmp_path))
    path = resolve_model("builtin:tiny")
    assert path == tmp_path / "models" / "builtin-tiny-v1"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
