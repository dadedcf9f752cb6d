"""The short version of crash and fault injection (``python -m tests.reliability.faults --rounds 60``
is the long one): each fault once (engine killed during forward_backward, optim_step and a save;
the API process killed; a full checkpoint disk where tmpfs can be mounted; a PostgreSQL restart on
that backend). Every request ends, no optim_step is applied twice or lost, no checkpoint is
half-written, and the client goes on."""

from tests.reliability.faults import run_faults
from tests.store.backend import backend


def test_faults_lose_nothing_and_apply_nothing_twice(tmp_path):
    report = run_faults(tmp_path, rounds=6 if backend() == "postgresql" else 5)
    c = report["checkpoints"]
    assert report["requests_never_ended"] == 0, report
    assert c["verified"] >= 5 and c.get("duplicates", 0) == 0 and c.get("lost", 0) == 0, c
    assert c.get("weights_differ", 0) == 0 and c.get("corrupt", 0) == 0 and c["stale_staging_folders"] == 0, c
    assert all(n.get("clear", True) for n in report["notes"]), report["notes"]
    assert report["recovery_s"]["max"] < 60, report["recovery_s"]
