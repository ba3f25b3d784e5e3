"""Fault injection for tests, drills and `pdq chaos`: off unless `PDQ_FAULTS` is set.

    PDQ_FAULTS="kv_corrupt=2,kv_drop=1,kv_delay_ms=500,decode_step_delay_ms=20"

kv_corrupt=N   flip a byte in one data chunk of each of the next N KV hand-offs this process sends
kv_drop=N      leave one data chunk out of each of the next N hand-offs
kv_delay_ms=X  wait X ms before each hand-off
decode_step_delay_ms=X  wait X ms after every forward pass of a decode (or colocated) worker: a slow worker
kv_corrupt_on_signal   every SIGUSR1 the process receives arms one more kv_corrupt: the next hand-off
               it sends after the signal is corrupted, once per signal (a harness picks the moment:
               `kill -USR1 <prefill worker pid>`). The handler is installed by `Faults.from_env()`
               when it runs on the main thread (a prefill worker's `build_server`, before the
               worker reports SERVING): send the signal only to a worker that is SERVING, as
               SIGUSR1 kills a process that has no handler for it.

Counts are per process and start at process start; a restarted process starts afresh.
"""

import os
import signal
import threading
from collections.abc import Iterator

NAMES = ("kv_corrupt", "kv_drop", "kv_delay_ms", "decode_step_delay_ms", "kv_corrupt_on_signal")


class Faults:
    def __init__(self, spec: str = ""):
        self.counts: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            if name not in NAMES:
                raise ValueError(f"PDQ_FAULTS: unknown fault {name!r} (known: {', '.join(NAMES)})")
            self.counts[name] = float(value or 1)
        self._lock = threading.Lock()
        # One entry per SIGUSR1 (list.append is atomic, also against a handler that interrupts
        # the main thread inside take()); _signals_taken of them were spent on hand-offs.
        self._signals: list[int] = []
        self._signals_taken = 0

    @classmethod
    def from_env(cls) -> "Faults":
        faults = cls(os.environ.get("PDQ_FAULTS", ""))
        if "kv_corrupt_on_signal" in faults.counts:
            faults.install_signal_handler()
        return faults

    def install_signal_handler(self) -> bool:
        """Makes SIGUSR1 arm one more kv_corrupt. Only the main thread can install a handler:
        elsewhere this does nothing. -> whether it was installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGUSR1, lambda signum, frame: self.arm())
        return True

    def arm(self) -> None:
        """One more kv_corrupt (what SIGUSR1 does under kv_corrupt_on_signal)."""
        self._signals.append(1)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def get(self, name: str) -> float:
        if name == "kv_corrupt":
            return self.counts.get(name, 0.0) + len(self._signals) - self._signals_taken
        return self.counts.get(name, 0.0)

    def take(self, name: str) -> bool:
        """True (and one fewer left) when fault `name` should fire now."""
        with self._lock:
            left = self.counts.get(name, 0)
            if left >= 1:
                self.counts[name] = left - 1
                return True
            if name == "kv_corrupt" and len(self._signals) > self._signals_taken:
                self._signals_taken += 1
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
