"""Stage 7, flag run: ``sample_use_retrieve_futures`` + ``sample_join_sampling_session``, handed out by
an API-only server on the same database. Concurrent samples (several sequences each) complete
through one ``retrieve_futures`` long-poll per client and equal the same requests on the default
server (same weights, same seeds); a SamplingClient pickled into a spawned process gets its clone
id from ``join_sampling_session`` (client 1: seq_ids from 1e9) and samples the same there."""

import multiprocessing as mp

import numpy as np
import tinker
from sqlalchemy import select
from tinker import types

from ember.store import Store
from ember.store.models import Future, SamplingSession
from tests.conformance.scenarios.common import CONF, QWEN3, random_datum

BLOCK = 1_000_000_000


def requests() -> list[tuple[types.ModelInput, int, types.SamplingParams]]:
    """Six sampling requests: random prompts, seeded and greedy, one to three sequences each."""
    rng = np.random.default_rng(71)
    prompts = [types.ModelInput.from_ints(rng.integers(0, 512, n).tolist()) for n in (5, 9, 3, 7)]
    return [
        (prompts[0], 1, types.SamplingParams(max_tokens=6, temperature=1.0, seed=1, stop=[])),
        (prompts[1], 3, types.SamplingParams(max_tokens=5, temperature=0.8, seed=2, stop=[])),
        (prompts[2], 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])),
        (prompts[0], 2, types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])),
        (prompts[3], 1, types.SamplingParams(max_tokens=6, temperature=1.0, seed=4, stop=[])),
        (prompts[1], 2, types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])),
    ]


def sample_all(sampler: tinker.SamplingClient, reqs) -> list[types.SampleResponse]:
    futures = [sampler.sample(prompt, n, params) for prompt, n, params in reqs]  # all in flight at once
    return [f.result() for f in futures]


def tokens(results: list[types.SampleResponse]) -> list[list[list[int]]]:
    return [[s.tokens for s in r.sequences] for r in results]


def child(sampler: tinker.SamplingClient, reqs, out) -> None:
    """In a spawned process: sample with the unpickled client, report tokens and its clone id."""
    results = sample_all(sampler, reqs)
    # Close the client's (shadow) holder before exiting, as a worker should: its futures poller
    # sends a last ack-only poll and the HTTP pools close. (Exiting with them open can abort the
    # interpreter at shutdown.)
    sampler.holder.run_coroutine_threadsafe(sampler.holder.aclose()).result()
    out.put((tokens(results), sampler._cloned_sampler_id))


def snapshot(sc: tinker.ServiceClient) -> tinker.SamplingClient:
    """A trained LoRA's sampler; the same seed and data give the same weights on either server."""
    rng = np.random.default_rng(72)
    tc = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=72).result()
    tc.forward_backward([random_datum(rng, n) for n in (8, 6)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return tc.save_weights_and_get_sampling_client().result()


def main() -> None:
    reqs = requests()
    ref_sc = tinker.ServiceClient()
    ref_snap = snapshot(ref_sc)
    ref = sample_all(ref_snap, reqs)

    sc = tinker.ServiceClient(base_url=CONF["extra"]["futures"])
    snap = snapshot(sc)
    cfg = sc.holder.get_client_config()
    assert cfg.sample_use_retrieve_futures and cfg.sample_join_sampling_session, cfg
    got = sample_all(snap, reqs)
    assert tokens(got) == tokens(ref)
    assert [len(r.sequences) for r in got] == [n for _, n, _ in reqs]
    for a, b in zip(got, ref):
        for sa, sb in zip(a.sequences, b.sequences):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)
    print("concurrent samples ok")

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=child, args=(snap, reqs[:3], out))
    proc.start()
    child_tokens, clone = out.get(timeout=120)
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    assert clone == 1, clone  # the first client to join this sampler
    assert child_tokens == tokens(ref[:3])
    print("pickled child ok")

    store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)
    try:
        with store.read() as s:
            assert s.get(SamplingSession, snap._sampling_session_id).clients == 1
            rows = s.execute(
                select(Future.seq_id, Future.reported).where(Future.sampler_id == snap._sampling_session_id)
            ).all()
            ref_rows = s.execute(
                select(Future.reported).where(Future.sampler_id == ref_snap._sampling_session_id)
            ).all()
    finally:
        store.close()
    assert sorted(seq for seq, _ in rows) == [0, 1, 2, 3, 4, 5, BLOCK, BLOCK + 1, BLOCK + 2], rows
    # every request was reported by retrieve_futures; the default server's clients never poll it
    assert all(reported is not None for _, reported in rows), rows
    assert len(ref_rows) == len(reqs) and all(reported is None for (reported,) in ref_rows), ref_rows
    sc.close("success").result()
    ref_sc.close("success").result()
    print("stage 7 flags ok")


if __name__ == "__main__":  # the spawned child imports this module too
    main()
