"""The names of the MLflow tags raysplit sets on a run, in one place (what the surface writes and reads back:
resuming, comparing, sweeps). A building block of the surface: no import of its own."""

VERSION = "raysplit.version"  # the package's version the run ran
COMMIT = "raysplit.commit"  # the checkout's commit, "-dirty" when tracked files differ; "unknown" outside a checkout
ALGORITHM = "raysplit.algorithm"  # the method's name
CHECKPOINT = "raysplit.checkpoint"  # the path of the run's last checkpoint (what --resume reads)
ACTOR_RESTARTS = "raysplit.actor_restarts"  # how many times a run's actors were replaced after a death
STOPPED = "raysplit.stopped"  # why a run stopped before its last round (interrupted, ended by Tune)
ERROR = "raysplit.error"  # the error that failed a run
ARM = "raysplit.arm"  # a sweep trial's arm (a set of overrides, one per method of a study)
SWEEP = "raysplit.sweep"  # the sweep a trial belongs to


def restart(count: int) -> str:
    """The tag naming why the run's actors were replaced the ``count``-th time."""
    return f"raysplit.restart_{count}"


def dropped(rnd: int) -> str:
    """The tag naming the clients dropped in round ``rnd`` (``runtime.faults.on_bad_client: drop``) and why."""
    return f"raysplit.dropped.round_{rnd}"


DROPPED_PREFIX = "raysplit.dropped."
