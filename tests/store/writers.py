"""Child-process body of the concurrent-writers test (kept small: spawned processes import it)."""

from __future__ import annotations

import threading
import traceback

from ember.store import Store


def run_writers(url: str, session_id: str, model_ids: list[str], rounds: int, out) -> None:
    """One thread per model: submit, heartbeat and complete ``rounds`` requests; report errors."""
    store = Store.open(url, pool_size=len(model_ids), run_migrations=False)
    errors: list[str] = []
    start = threading.Barrier(len(model_ids))

    def writer(model_id: str) -> None:
        try:
            start.wait()
            for seq in range(1, rounds + 1):
                rid = store.submit(owner="o", base_model="b", op="forward_backward", payload=b"x" * 1024,
                                   model_id=model_id, seq_id=seq, n_tokens=8)
                assert store.submit(owner="o", base_model="b", op="forward_backward", payload=b"y",
                                    model_id=model_id, seq_id=seq) == rid  # idempotent resubmission
                store.heartbeat(session_id, "o")
                store.finish([(rid, b"result", None, None)], advance={model_id: seq + 1})
        except Exception:  # noqa: BLE001 - reported to the parent
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=writer, args=(m,)) for m in model_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    out.put(errors)
