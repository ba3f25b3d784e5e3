"""Starting a benchmark's own cluster (`pdq bench --spawn`, `--capacity`)."""

from collections.abc import Callable

from pdq.ops.up import Cluster

# A start-up that fails (e.g. a port taken in between by another process) is tried again.
START_ATTEMPTS = 3


def start_cluster(what: str, say: Callable[[str], None], **cluster: object) -> Cluster:
    """A started `Cluster(**cluster)`; `what` names it in the progress lines."""
    for attempt in range(1, START_ATTEMPTS + 1):
        say(f"pdq bench: starting a cluster for {what} ...")
        started = Cluster(**cluster)  # type: ignore[arg-type]
        try:
            return started.start()
        except (RuntimeError, TimeoutError) as exc:
            if attempt == START_ATTEMPTS:
                raise
            say(f"pdq bench: the cluster did not start ({exc}); trying again")
    raise AssertionError("unreachable")
