"""The stability records of an engine, and the provenance of training datums resolved against them.

A sampling request with ``record_stability_info`` leaves, for every sequence it returns, a
:class:`StabilityRecord` keyed by the sequence's ``sequence_id`` (``{request id}:{index}``, what the
API hands the client): the prompt and sampled tokens, the sampler's parameters, what each token
was drawn from (the kept set with the sampler's renormalised probabilities, or the head of an
untruncated distribution) and, for MoE models, the experts of every token in every MoE layer
(``shared/spec/stability.md``). A ``stable_reinforce`` datum names these records in its
provenance spans; :func:`resolve_datum` checks the spans against them and builds what the worker
replays (:class:`ember.types.SupportReplay` and the datum's routes).

:class:`StabilityStore` keeps the records in host memory up to a budget, spills the least recently
used ones to files under a local folder up to a second budget, and forgets records that were not
used for ``ttl_s`` seconds or whose sampler's session ended. A datum that names a forgotten record
fails with an error that says why; nothing falls back silently to unrecorded numbers.
"""

from __future__ import annotations

import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ember.types import Datum, InvalidRequest, SampledSequence, SampleInput, SupportReplay

KIND_NONE, KIND_KEPT, KIND_HEAD = 0, 1, 2
_FORGOTTEN_MAX = 100_000  # remembered reasons for forgotten records (for the error a later datum gets)


@dataclass
class StabilityRecord:
    """One sampled sequence's stability record (see module doc)."""

    session_id: str
    sampler_id: str
    prompt: np.ndarray  # int32 [P]
    tokens: np.ndarray  # int32 [G]
    temperature: float
    top_k: int
    top_p: float
    truncated: bool  # ids: the kept set (top-k / top-p), or the head of the full distribution
    ids: np.ndarray  # int32 [G, K], -1 padded
    q: np.ndarray  # float32 [G, K]
    mass: np.ndarray  # float32 [G]
    logprob: np.ndarray  # float32 [G]: log q of the sampled token
    routes: np.ndarray | None = None  # int16 / uint8 [P + G - 1, L, k]
    route_layers: tuple[int, ...] = ()

    @classmethod
    def of_sample(cls, session_id: str, sampler_id: str, inp: SampleInput, seq: SampledSequence,
                  route_layers: tuple[int, ...]) -> StabilityRecord:
        """The record of one sequence sampled for ``inp`` (with ``record_stability``)."""
        sup = seq.support
        return cls(
            session_id=session_id, sampler_id=sampler_id, prompt=np.asarray(inp.prompt, np.int32),
            tokens=np.asarray(seq.tokens, np.int32), temperature=float(inp.params.temperature),
            top_k=int(inp.params.top_k), top_p=float(inp.params.top_p), truncated=bool(sup.truncated),
            ids=sup.ids, q=sup.q, mass=sup.mass, logprob=sup.logprob,
            routes=None if seq.routing is None else compact_routes(seq.routing), route_layers=tuple(route_layers),
        )

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray))

    def save(self, path: Path) -> None:
        """Write the record to ``path`` (an ``.npz``)."""
        arrays = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        arrays["route_layers"] = np.asarray(self.route_layers, np.int64)
        with open(path, "wb") as fh:
            np.savez(fh, **{k: np.asarray(v) for k, v in arrays.items()})

    @classmethod
    def load(cls, path: Path) -> StabilityRecord:
        with np.load(path, allow_pickle=False) as z:
            kw = {k: z[k] for k in z.files}
        for name in ("session_id", "sampler_id"):
            kw[name] = str(kw[name])
        for name, cast in (("temperature", float), ("top_k", int), ("top_p", float), ("truncated", bool)):
            kw[name] = cast(kw[name])
        kw["route_layers"] = tuple(int(x) for x in kw["route_layers"])
        return cls(**kw)


def compact_routes(routes: np.ndarray) -> np.ndarray:
    """Expert ids in the smallest unsigned or 16-bit type that holds them (16 B per token per
    MoE layer at top-8 with up to 32k experts)."""
    top = int(routes.max()) if routes.size else 0
    return routes.astype(np.uint8 if top < 256 else np.int16)


class RecordMissing(InvalidRequest):
    """A datum names a record this engine does not hold (unknown, another session's, or forgotten)."""


class StabilityStore:
    """Records by ``sequence_id``: host memory up to ``memory_bytes``, then files up to
    ``disk_bytes`` (least recently used first), forgotten after ``ttl_s`` seconds unused."""

    def __init__(self, memory_bytes: int = 2 << 30, disk_bytes: int = 16 << 30, ttl_s: float = 3600.0,
                 spill_dir: str | Path | None = None, clock=time.monotonic):
        self.memory_bytes, self.disk_bytes, self.ttl_s = memory_bytes, disk_bytes, ttl_s
        self._clock = clock
        self._spill_root = spill_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._memory: OrderedDict[str, StabilityRecord] = OrderedDict()
        self._disk: OrderedDict[str, tuple[Path, int, str, str]] = OrderedDict()  # path, bytes, session, sampler
        self._used: dict[str, float] = {}
        self._forgotten: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (session, why)
        self.memory_used = 0
        self.disk_used = 0
        self._seq = 0

    def __len__(self) -> int:
        return len(self._memory) + len(self._disk)

    # -- writing --------------------------------------------------------------------------------

    def put(self, sequence_id: str, record: StabilityRecord) -> None:
        """Keep ``record`` (most recently used), spilling or evicting others to stay in budget."""
        self._discard(sequence_id)
        self._memory[sequence_id] = record
        self.memory_used += record.nbytes
        self._used[sequence_id] = self._clock()
        self._fit()

    def drop_sampler(self, sampler_id: str, reason: str) -> int:
        """Forget every record of ``sampler_id`` (its session ended); returns how many."""
        ids = [k for k, r in self._memory.items() if r.sampler_id == sampler_id]
        ids += [k for k, (_, _, _, sampler) in self._disk.items() if sampler == sampler_id]
        for k in ids:
            self._forget(k, reason)
        return len(ids)

    def expire(self) -> int:
        """Forget the records unused for ``ttl_s`` seconds; returns how many."""
        cutoff = self._clock() - self.ttl_s
        old = [k for k, t in self._used.items() if t < cutoff]
        for k in old:
            self._forget(k, f"it expired after {self.ttl_s:g} s without use")
        return len(old)

    # -- reading --------------------------------------------------------------------------------

    def get(self, sequence_id: str, session_id: str) -> StabilityRecord:
        """The record of ``sequence_id`` if it belongs to ``session_id``; :class:`RecordMissing`
        (the same message whether it is unknown or another session's) otherwise."""
        rec = self._memory.get(sequence_id)
        if rec is None and sequence_id in self._disk:
            path, _, session, _ = self._disk[sequence_id]
            if session == session_id:
                rec = StabilityRecord.load(path)
                self._discard(sequence_id)
                self._memory[sequence_id] = rec
                self.memory_used += rec.nbytes
        if rec is None or rec.session_id != session_id:
            session, why = self._forgotten.get(sequence_id, (None, None)) if rec is None else (None, None)
            if why is not None and session == session_id:
                raise RecordMissing(f"sequence_id {sequence_id!r} has no stability record any more: {why}")
            raise RecordMissing(
                f"sequence_id {sequence_id!r} has no stability record in this session: sample with "
                "record_stability_info=True in the same session and base model, then train")
        self._memory.move_to_end(sequence_id)
        self._used[sequence_id] = self._clock()
        self._fit()
        return rec

    # -- budget ---------------------------------------------------------------------------------

    def _fit(self) -> None:
        while self.memory_used > self.memory_bytes and len(self._memory) > 1:
            key, rec = self._memory.popitem(last=False)
            self.memory_used -= rec.nbytes
            if rec.nbytes > self.disk_bytes:
                self._forgotten[key] = (rec.session_id, "the engine's stability-record budget was exceeded")
                self._used.pop(key, None)
                continue
            path = self._spill_dir() / f"{self._seq}.npz"
            self._seq += 1
            rec.save(path)
            self._disk[key] = (path, rec.nbytes, rec.session_id, rec.sampler_id)
            self.disk_used += rec.nbytes
        while self.disk_used > self.disk_bytes and self._disk:
            key = next(iter(self._disk))
            self._forget(key, "the engine's stability-record budget (memory and disk) was exceeded")

    def _spill_dir(self) -> Path:
        if self._tmp is None:
            if self._spill_root is not None:
                Path(self._spill_root).mkdir(parents=True, exist_ok=True)
            self._tmp = tempfile.TemporaryDirectory(prefix="ember-stability-", dir=self._spill_root)
        return Path(self._tmp.name)

    def _discard(self, key: str) -> None:
        rec = self._memory.pop(key, None)
        if rec is not None:
            self.memory_used -= rec.nbytes
        spilled = self._disk.pop(key, None)
        if spilled is not None:
            spilled[0].unlink(missing_ok=True)
            self.disk_used -= spilled[1]
        self._used.pop(key, None)

    def _forget(self, key: str, reason: str) -> None:
        rec = self._memory.get(key)
        session = rec.session_id if rec is not None else self._disk[key][2] if key in self._disk else None
        self._discard(key)
        self._forgotten[key] = (session, reason)
        if len(self._forgotten) > _FORGOTTEN_MAX:
            self._forgotten.popitem(last=False)


# -- provenance ---------------------------------------------------------------------------------------

Span = tuple[str, str, int, int]  # ("prompt" | "sampled", sequence_id, offset, length)


def resolve_datum(
    store: StabilityStore, session_id: str, datum: Datum, input_spans: list[Span], target_spans: list[Span],
    where: str,
) -> Datum:
    """``datum`` with the support its target spans name and the routes its input spans name
    (``InvalidRequest`` naming the span when a record is missing or its tokens differ)."""
    tokens = np.asarray(datum.tokens)
    targets = np.asarray(datum.loss_inputs["target_tokens"])
    if targets.ndim != 1:
        raise InvalidRequest(f"{where}: stable_reinforce takes 1-D target_tokens, got shape {list(targets.shape)}")
    records: dict[str, StabilityRecord] = {}

    def record(span_id: str) -> StabilityRecord:
        if span_id not in records:
            records[span_id] = store.get(span_id, session_id)
        return records[span_id]

    routes, layers = None, ()
    for j, (kind, sid, off, length, pos) in enumerate(_walk(input_spans, tokens.size, f"{where}.model_input_spans")):
        rec = record(sid)
        source = _source(rec, kind, off, length, f"{where}.model_input_spans[{j}]")
        _same(tokens[pos : pos + length], source, f"{where}.model_input_spans[{j}]", "model input", sid, kind, off)
        if rec.routes is None:
            continue
        if routes is None:
            layers = rec.route_layers
            routes = np.full((tokens.size, *rec.routes.shape[1:]), -1, np.int64)
        if rec.route_layers != layers or rec.routes.shape[1:] != routes.shape[1:]:
            raise InvalidRequest(f"{where}.model_input_spans[{j}]: records of different models in one datum")
        start = off if kind == "prompt" else rec.prompt.size + off  # row of the record's routes
        rows = np.arange(start, start + length)
        have = rows < rec.routes.shape[0]  # the last sampled token was never fed to the sampler
        routes[pos : pos + length][have] = rec.routes[rows[have]]

    n = targets.size
    kinds = np.zeros(n, np.int8)
    inv_t = np.ones(n, np.float32)
    mass = np.zeros(n, np.float32)
    logprob = np.zeros(n, np.float32)
    rows: list[tuple[int, int, StabilityRecord, int]] = []  # (datum pos, length, record, offset)
    for j, (kind, sid, off, length, pos) in enumerate(_walk(target_spans, n, f"{where}.loss_fn_input_spans")):
        rec = record(sid)
        source = _source(rec, kind, off, length, f"{where}.loss_fn_input_spans[{j}]")
        if kind == "prompt":  # no term there; tinker-cookbook's rl_loop pads these targets with 0
            continue
        _same(targets[pos : pos + length], source, f"{where}.loss_fn_input_spans[{j}]", "target_tokens", sid, kind, off)
        if length:
            kinds[pos : pos + length] = KIND_KEPT if rec.truncated else KIND_HEAD
            inv_t[pos : pos + length] = 1.0 / rec.temperature if rec.temperature > 0 else 1.0
            mass[pos : pos + length] = rec.mass[off : off + length]
            logprob[pos : pos + length] = rec.logprob[off : off + length]
            rows.append((pos, length, rec, off))
    width = max((r.ids.shape[1] for _, _, r, _ in rows), default=0)
    ids = np.full((n, width), -1, np.int32)
    q = np.zeros((n, width), np.float32)
    for pos, length, rec, off in rows:
        k = rec.ids.shape[1]
        ids[pos : pos + length, :k] = rec.ids[off : off + length]
        q[pos : pos + length, :k] = rec.q[off : off + length]
    support = SupportReplay(kind=kinds, ids=ids, q=q, inv_temperature=inv_t, mass=mass, logprob=logprob)
    return Datum(tokens, datum.loss_inputs, routes=routes, route_layers=tuple(layers), support=support)


def _walk(spans: list[Span], total: int, where: str):
    """``(kind, sequence_id, offset, length, datum position)`` of spans that must tile ``total``."""
    pos = 0
    for kind, sid, off, length in spans:
        yield kind, sid, int(off), int(length), pos
        pos += int(length)
    if pos != total:
        raise InvalidRequest(f"{where}: spans cover {pos} positions, the datum has {total}")


def _source(rec: StabilityRecord, kind: str, off: int, length: int, where: str) -> np.ndarray:
    src = rec.prompt if kind == "prompt" else rec.tokens
    if off + length > src.size:
        what = "prompt" if kind == "prompt" else "sampled tokens"
        raise InvalidRequest(f"{where}: positions {off}..{off + length} lie beyond the record's {src.size} {what}")
    return src[off : off + length]


def _same(got: np.ndarray, want: np.ndarray, where: str, field: str, sid: str, kind: str, off: int) -> None:
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        what = "prompt" if kind == "prompt" else "sampled token"
        raise InvalidRequest(f"{where}: {field} token {int(got[bad])} differs from {what} {off + bad} of sequence "
                             f"{sid!r} ({int(want[bad])}): the span does not reproduce the record")
