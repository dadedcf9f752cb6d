"""AdamW on fp32 master weights whose state lives on the device, in host memory or in files.

Full fine-tuning (:mod:`ember.core.full_ft`) trains a model in its compute dtype (bf16 on GPUs).
:class:`MasterAdamW` keeps, per trainable parameter, an fp32 master copy and the two Adam moments
in one of three places (``storage``):

* ``none``: on the parameters' device (an fp32 parameter is its own master: no second copy);
* ``host``: in host memory, pinned when the parameters are on a GPU;
* ``disk:DIR``: in host memory up to ``host_budget_bytes``, the rest in one file under a folder of
  its own in ``DIR``, mapped into memory (``torch.from_file(shared=True)``). The file is written in
  full when the optimizer is created, so an unwritable folder or a full disk fails there, with
  the folder and the bytes named, and never in the middle of a step.

Layout: the state is three flat fp32 vectors (master, ``exp_avg``, ``exp_avg_sq``) over all
parameters in order, cut into *pieces*: slices of at most ``chunk_bytes / 4`` elements that never
cross a parameter. A step (:meth:`MasterAdamW.step`) first takes the global gradient norm (as
``clip_grad_norm_``: the total norm before clipping, coefficient ``min(1, max / (norm + 1e-6))``),
then streams the pieces of the parameters that have a gradient through the device: the piece's
state is copied in, ``torch._fused_adamw_`` updates it with the piece's (scaled) gradient, the new
master is cast into the parameter and the state copied back. With state off the device, on CUDA,
the copy in of the next piece runs on a side stream while the current one computes, and the copy
back on another, ordered by events; at most two pieces' state is on the device at a time. The
kernel and its inputs are the same in every mode, so the modes agree bitwise, and they equal
``torch.optim.AdamW(fused=True)`` on fp32 parameters.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.core.optim import AdamParams

STORAGES = ("none", "host", "disk:DIR")


@dataclass
class _Piece:
    param: int  # index into the parameters
    start: int  # in the parameter's flat view
    length: int
    offset: int  # in the flat state vectors


def parse_storage(storage: str) -> tuple[str, Path | None]:
    """``(kind, folder)`` of a ``storage`` string (``ValueError`` naming the allowed ones)."""
    if storage in ("none", "host"):
        return storage, None
    if storage.startswith("disk:") and len(storage) > 5:
        return "disk", Path(storage[5:]).expanduser()
    raise ValueError(f"optimizer storage must be one of {', '.join(STORAGES)}, got {storage!r}")


def host_available_bytes() -> int:
    """``MemAvailable`` of this host."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class MasterAdamW:
    """AdamW over fp32 master copies of ``params`` (``(name, parameter)``), state in ``storage``."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], storage: str = "none",
                 chunk_bytes: int = 256 << 20, host_budget_bytes: int | None = None):
        self.kind, folder = parse_storage(storage)
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.steps = [0] * len(self.params)
        self._folder: Path | None = None
        self._file: Path | None = None
        chunk = max(1, chunk_bytes // 4)
        self.pieces: list[_Piece] = []
        offset = 0
        for i, p in enumerate(self.params):
            for start in range(0, p.numel(), chunk):
                n = min(chunk, p.numel() - start)
                self.pieces.append(_Piece(i, start, n, offset))
                offset += n
        self.numel = offset
        self.resident = self.kind == "none"
        # master weights: an fp32 parameter on the device is its own master
        self._own_master = self.resident and all(p.dtype == torch.float32 for p in self.params)
        vectors = 2 if self._own_master else 3
        self.master, self.exp_avg, self.exp_avg_sq = self._allocate(vectors, folder, host_budget_bytes)
        with torch.no_grad():
            for piece in self.pieces:
                if self.master is not None:
                    self.master[piece.offset : piece.offset + piece.length].copy_(self._flat(piece))
        self._streams = None
        if not self.resident and self.device.type == "cuda":
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))

    # -- storage --------------------------------------------------------------------------------

    def _allocate(self, vectors: int, folder: Path | None, budget: int | None):
        n = self.numel
        if self.resident:
            made = [torch.zeros(n, dtype=torch.float32, device=self.device) for _ in range(vectors)]
            self._where = ["device"] * 3
            return ([None] if self._own_master else []) + made
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        if self.kind == "host":
            self._where = ["host"] * 3
            return [torch.zeros(n, dtype=torch.float32, pin_memory=pin) for _ in range(vectors)]
        budget = int(0.5 * host_available_bytes()) if budget is None else budget
        in_host = min(vectors, budget // max(1, 4 * n))  # whole vectors in host memory, the others on disk
        on_disk = vectors - in_host
        self._where = ["host"] * in_host + ["disk"] * on_disk
        out = [torch.zeros(n, dtype=torch.float32, pin_memory=pin) for _ in range(in_host)]
        if on_disk:
            out += self._files(folder, on_disk, n)
        return out

    def _files(self, folder: Path, count: int, n: int) -> list[torch.Tensor]:
        """``count`` fp32 vectors of ``n`` elements in one preallocated file under ``folder``."""
        need = 4 * n * count
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix="ember-optimizer-", dir=folder))
            free = shutil.disk_usage(self._folder).free
            if free < need:
                raise OSError(errno.ENOSPC, f"{free} bytes free")
            self._file = self._folder / "state.bin"
            with open(self._file, "wb") as f:
                block = bytes(64 << 20)
                left = need
                while left:  # written, not just sized: a sparse file could still run out mid-step
                    left -= f.write(block[: min(len(block), left)])
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self.close()
            raise ValueError(f"optimizer offload folder {folder}: cannot hold {need / 2**30:.2f} GiB of optimizer "
                             f"state ({e.strerror or e})") from None
        whole = torch.from_file(str(self._file), shared=True, size=n * count, dtype=torch.float32)
        return list(whole.view(count, n).unbind(0))

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state on the device, in host memory and on disk."""
        out = {"device": 0, "host": 0, "disk": 0}
        for t, where in zip((self.master, self.exp_avg, self.exp_avg_sq), self._where):
            if t is not None:
                out[where] += t.numel() * 4
        return out

    def close(self) -> None:
        """Free the state and remove its files."""
        self.master = self.exp_avg = self.exp_avg_sq = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    # -- stepping -------------------------------------------------------------------------------

    def _flat(self, piece: _Piece) -> torch.Tensor:
        return self.params[piece.param].detach().view(-1)[piece.start : piece.start + piece.length]

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, hp: AdamParams) -> dict[str, float]:
        """Clip (if asked), update, clear gradients; returns ``grad_norm`` (before clipping)."""
        hp.validate()
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return {"grad_norm": 0.0}
        grads = [self.params[i].grad for i in live]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        max_norm = hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for i in live:
            self.steps[i] += 1
        pieces = [pc for pc in self.pieces if self.params[pc.param].grad is not None]
        kw = dict(lr=hp.learning_rate, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
                  amsgrad=False, maximize=False)
        state = (self.master, self.exp_avg, self.exp_avg_sq)
        streams = self._streams
        staged = self._stage(pieces[0], streams) if pieces else None
        for k, piece in enumerate(pieces):
            bufs, ready = staged
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            if k + 1 < len(pieces):  # the next piece's state comes in while this one computes
                staged = self._stage(pieces[k + 1], streams)
            p = self.params[piece.param]
            grad = p.grad.view(-1)[piece.start : piece.start + piece.length].float() * coef
            target = self._flat(piece)
            master = target if self._own_master else bufs[0]
            m, v = bufs[-2], bufs[-1]
            step = torch.tensor(float(self.steps[piece.param]), device=self.device)
            torch._fused_adamw_([master], [grad], [m], [v], [], [step], **kw)
            if not self._own_master:
                target.copy_(master)
            if not self.resident:
                self._unstage(piece, bufs, state, streams)
        if streams is not None:
            torch.cuda.current_stream(self.device).wait_stream(streams[1])
        self.zero_grad()
        return {"grad_norm": float(norm)}

    def _stage(self, piece: _Piece, streams):
        """The piece's state on the device (views of the resident vectors, or copies) and the
        event its copies end with (``None``: nothing to wait for)."""
        lo, hi = piece.offset, piece.offset + piece.length
        vectors = [t for t in (self.master, self.exp_avg, self.exp_avg_sq) if t is not None]
        if self.resident:
            return [t[lo:hi] for t in vectors], None
        if streams is None:  # a CPU model: the host state is where it computes
            return [t[lo:hi].clone() for t in vectors], None
        copy_in = streams[0]
        copy_in.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy_in):
            bufs = [t[lo:hi].to(self.device, non_blocking=True) for t in vectors]
            ready = torch.cuda.Event()
            ready.record(copy_in)
        for b in bufs:
            b.record_stream(torch.cuda.current_stream(self.device))
        return bufs, ready

    def _unstage(self, piece: _Piece, bufs: list[torch.Tensor], state, streams) -> None:
        lo, hi = piece.offset, piece.offset + piece.length
        vectors = [t for t in state if t is not None]
        if streams is None:
            for t, b in zip(vectors, bufs):
                t[lo:hi].copy_(b)
            return
        copy_out = streams[1]
        copy_out.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy_out):
            for t, b in zip(vectors, bufs):
                t[lo:hi].copy_(b, non_blocking=True)
                b.record_stream(copy_out)

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU fp32 tensors ``{name}.master`` / ``.exp_avg`` / ``.exp_avg_sq`` and ``{name}.step``."""
        if self._streams is not None:
            torch.cuda.synchronize(self.device)
        out = {}
        for piece_param, (name, p) in enumerate(zip(self.names, self.params)):
            lo = next(pc.offset for pc in self.pieces if pc.param == piece_param) if p.numel() else 0
            hi = lo + p.numel()
            master = p.detach().reshape(-1) if self._own_master else self.master[lo:hi]
            for key, t in (("master", master), ("exp_avg", self.exp_avg[lo:hi]), ("exp_avg_sq", self.exp_avg_sq[lo:hi])):
                out[f"{name}.{key}"] = t.detach().to("cpu", torch.float32, copy=True).view(p.shape)
            out[f"{name}.step"] = torch.tensor(float(self.steps[piece_param]))
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the state saved by :meth:`state_dict` (and the parameters to its master weights)."""
        want = {f"{n}.{k}" for n in self.names for k in ("master", "exp_avg", "exp_avg_sq", "step")}
        if set(state) != want:
            missing, extra = sorted(want - set(state)), sorted(set(state) - want)
            raise ValueError(f"optimizer state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                if tuple(state[f"{name}.{key}"].shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {name}.{key} has shape {tuple(state[f'{name}.{key}'].shape)}, "
                                     f"the parameter {tuple(p.shape)}")
            self.steps[i] = int(state[f"{name}.step"])
        for piece in self.pieces:
            name, p = self.names[piece.param], self.params[piece.param]
            sl = slice(piece.start, piece.start + piece.length)
            lo, hi = piece.offset, piece.offset + piece.length
            master = state[f"{name}.master"].reshape(-1)[sl]
            if self._own_master:
                self._flat(piece).copy_(master)
            else:
                self.master[lo:hi].copy_(master)
                self._flat(piece).copy_(master)
            self.exp_avg[lo:hi].copy_(state[f"{name}.exp_avg"].reshape(-1)[sl])
            self.exp_avg_sq[lo:hi].copy_(state[f"{name}.exp_avg_sq"].reshape(-1)[sl])
