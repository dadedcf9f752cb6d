"""Two clients train different adapters at the same time, on both base models; each gets exactly
what it gets training alone. While the engine is busy with a third adapter's large batch, the two
clients' requests queue up and run together in one packed pass (the engine's pass counter shows
fewer passes than forward_backward requests)."""

import threading

import numpy as np
import tinker
from tinker import types

from ember.store import Store
from tests.conformance.scenarios.common import CONF, MOE, QWEN3, arr, random_datum

adam = types.AdamParams(learning_rate=2e-2)
STEPS = 3


def batches(seed):
    rng = np.random.default_rng(seed)
    return [[random_datum(rng, n) for n in (8, 13)] for _ in range(STEPS)]


def train(tc, data, out, busy=None):
    losses = []
    for step in range(STEPS):
        if busy is not None:
            busy.wait()
        f = tc.forward_backward(data[step], "cross_entropy")
        o = tc.optim_step(adam)
        losses.append(f.result().metrics["loss:sum"])
        o.result()
    final = tc.forward(data[0], "cross_entropy").result()
    out.extend([losses, [arr(x["logprobs"]) for x in final.loss_fn_outputs]])


def train_after(barrier, tc, data, out, busy):
    barrier.wait()
    train(tc, data, out, busy)


store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)
for base in (QWEN3, MOE):
    sc = tinker.ServiceClient()
    data = {"a": batches(1), "b": batches(2)}
    alone = {}
    for name, seed in (("a", 11), ("b", 12)):
        tc = sc.create_lora_training_client(base_model=base, rank=8, seed=seed).result()
        alone[name] = []
        train(tc, data[name], alone[name])

    clients = {name: sc.create_lora_training_client(base_model=base, rank=8, seed=seed).result()
               for name, seed in (("a", 11), ("b", 12))}
    hog = sc.create_lora_training_client(base_model=base, rank=8, seed=13).result()
    big = [random_datum(np.random.default_rng(3), 700) for _ in range(3)]
    passes_before = next(e.passes for e in store.engines() if e.base_model == base)
    together = {"a": [], "b": []}
    go = threading.Barrier(3)
    busy = threading.Event()
    threads = [threading.Thread(target=train_after, args=(go, clients[n], data[n], together[n], busy))
               for n in ("a", "b")]
    for t in threads:
        t.start()
    go.wait()
    hog_futures = []
    for _ in range(STEPS):
        hog_futures.append(hog.forward(big, "cross_entropy"))  # keeps the engine busy
        busy.set()
    for t in threads:
        t.join()
    for f in hog_futures:
        f.result()
    passes = next(e.passes for e in store.engines() if e.base_model == base) - passes_before
    fwd_requests = 2 * (STEPS + 1) + STEPS
    for name in ("a", "b"):
        np.testing.assert_allclose(together[name][0], alone[name][0], rtol=1e-5)
        for x, y in zip(together[name][1], alone[name][1]):
            np.testing.assert_allclose(x, y, atol=1e-5)
    print(base, f"{fwd_requests} forward/backward requests ran in {passes} passes")
    assert passes < fwd_requests, "concurrent adapters never shared a pass"
    sc.close("success").result()
store.close()
print("multi-tenant ok")
