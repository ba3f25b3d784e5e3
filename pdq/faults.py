"""Fault injection for tests and drills: off unless `PDQ_FAULTS` is set.

    PDQ_FAULTS="kv_corrupt=2,kv_drop=1,kv_delay_ms=500,decode_step_delay_ms=20"

kv_corrupt=N   flip a byte in one data chunk of each of the next N KV hand-offs this process sends
kv_drop=N      leave one data chunk out of each of the next N hand-offs
kv_delay_ms=X  wait X ms before each hand-off
decode_step_delay_ms=X  wait X ms after every forward pass of a decode (or colocated) worker: a slow worker
"""

import os
import threading
from collections.abc import Iterator


class Faults:
    def __init__(self, spec: str = ""):
        self.counts: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            if name not in ("kv_corrupt", "kv_drop", "kv_delay_ms", "decode_step_delay_ms"):
                raise ValueError(f"PDQ_FAULTS: unknown fault {name!r}")
            self.counts[name] = float(value or 1)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(os.environ.get("PDQ_FAULTS", ""))

    def __bool__(self) -> bool:
        return bool(self.counts)

    def get(self, name: str) -> float:
        return self.counts.get(name, 0.0)

    def take(self, name: str) -> bool:
        """True (and one fewer left) when fault `name` should fire now."""
        with self._lock:
            left = self.counts.get(name, 0)
            if left >= 1:
                self.counts[name] = left - 1
                return True
            return False

    def kv_frames(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        """Passes a hand-off's serialized chunks (`kv_transfer.encode_frames`) through, corrupting
        or dropping one data chunk if due; a data chunk's last byte is its payload's."""
        corrupt, drop = self.take("kv_corrupt"), self.take("kv_drop")
        done = False
        for frame in frames:
            if not done and frame[:1] == b"\x12":
                done = True
                if drop:
                    continue
                if corrupt:
                    frame = frame[:-1] + bytes([frame[-1] ^ 0x5A])
            yield frame
