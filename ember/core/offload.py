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

With ``host`` or ``disk``, ``device_budget_bytes`` keeps the state of the first parameters (whole
parameters, in order, up to that many bytes) on the device anyway, as ZeRO-Offload's partial
offload (``ratio``) does: those parameters step on the device while the others stream, so a GPU
with memory to spare moves fewer bytes over the host link.

Layout: the state is three flat fp32 vectors (master, ``exp_avg``, ``exp_avg_sq``) per *tier*
(the device-resident parameters, then the streamed ones) over its parameters in order, cut into
*pieces*: slices of at most ``chunk_bytes / 4`` elements that never cross a parameter. A step (:meth:`MasterAdamW.step`) first takes the global gradient norm (as
``clip_grad_norm_``: the total norm before clipping, coefficient ``min(1, max / (norm + 1e-6))``),
then streams the pieces of the parameters that have a gradient through the device: the piece's
state is copied in, ``torch._fused_adamw_`` updates it with the piece's (scaled) gradient, the new
master is cast into the parameter and the state copied back. With state off the device, on CUDA,
the copy in of the next piece runs on a side stream while the current one computes (and while
resident pieces, interleaved between the streamed ones, compute), and the copy back on another,
ordered by events; at most two streamed pieces' state is on the device at a time. The
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

from ember.core.optim import AdamParams, total_norm

STORAGES = ("none", "host", "disk:DIR")


@dataclass
class _Piece:
    param: int  # index into the parameters
    start: int  # in the parameter's flat view
    length: int
    tier: int  # 0: state on the device, 1: state streamed from host memory or disk
    offset: int  # in its tier's flat state vectors


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
                 chunk_bytes: int = 256 << 20, host_budget_bytes: int | None = None, device_budget_bytes: int = 0):
        self.kind, folder = parse_storage(storage)
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.steps = [0] * len(self.params)
        self._folder: Path | None = None
        self._file: Path | None = None
        self.state: list[list[torch.Tensor]] = [[], []]  # the device tier's vectors, the streamed tier's
        # master weights: with everything on the device, an fp32 parameter is its own master
        self._own_master = self.kind == "none" and all(p.dtype == torch.float32 for p in self.params)
        self.vectors = 2 if self._own_master else 3
        tiers = self._tiers(device_budget_bytes)
        chunk = max(1, chunk_bytes // 4)
        self.pieces: list[_Piece] = []
        self._where_param: list[tuple[int, int]] = []  # each parameter's (tier, offset): contiguous there
        sizes = [0, 0]
        for i, p in enumerate(self.params):
            tier = tiers[i]
            self._where_param.append((tier, sizes[tier]))
            for start in range(0, p.numel(), chunk):
                n = min(chunk, p.numel() - start)
                self.pieces.append(_Piece(i, start, n, tier, sizes[tier]))
                sizes[tier] += n
        self.numel = sum(sizes)
        self.state = [self._resident(sizes[0]), self._allocate(sizes[1], folder, host_budget_bytes)]
        with torch.no_grad():
            for piece in self.pieces:
                if not self._own_master:
                    self._views(piece)[0].copy_(self._flat(piece))
        self._streams = None
        if sizes[1] and self.device.type == "cuda":
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))

    # -- storage --------------------------------------------------------------------------------

    def _tiers(self, device_budget: int) -> list[int]:
        """Each parameter's tier: all on the device with ``none``, else the leading parameters whose
        state fits ``device_budget`` bytes, the rest streamed."""
        if self.kind == "none":
            return [0] * len(self.params)
        out, used = [], 0
        for p in self.params:
            need = 4 * self.vectors * p.numel()
            fits = not out or out[-1] == 0  # a prefix: once one is streamed, so are the rest
            if fits and used + need <= device_budget:
                used += need
                out.append(0)
            else:
                out.append(1)
        return out

    def _resident(self, n: int) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=torch.float32, device=self.device) for _ in range(self.vectors)]

    def _allocate(self, n: int, folder: Path | None, budget: int | None) -> list[torch.Tensor]:
        """The streamed tier's vectors: pinned host memory, or host memory and a file."""
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        if self.kind != "disk":
            self._where = ["host"] * self.vectors
            return [torch.zeros(n, dtype=torch.float32, pin_memory=pin and n > 0) for _ in range(self.vectors)]
        budget = int(0.5 * host_available_bytes()) if budget is None else budget
        in_host = min(self.vectors, budget // max(1, 4 * n))  # whole vectors in host memory, the others on disk
        on_disk = self.vectors - in_host
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
        resident, streamed = self.state
        out["device"] = sum(t.numel() * 4 for t in resident)
        for t, where in zip(streamed, self._where):
            out[where] += t.numel() * 4
        return out

    def close(self) -> None:
        """Free the state (pinned host memory back to the system, not only to PyTorch's cache of
        pinned blocks, which would keep it from the next run) and remove its files."""
        pinned = any(t.is_pinned() for t in self.state[1])
        self.state = [[], []]
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if pinned and empty_host_cache is not None:
            empty_host_cache()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _views(self, piece: _Piece) -> list[torch.Tensor]:
        """The piece's slices of its tier's state vectors (``[master,] exp_avg, exp_avg_sq``)."""
        return [t[piece.offset : piece.offset + piece.length] for t in self.state[piece.tier]]

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
        norm = total_norm(grads)
        max_norm = hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for i in live:
            self.steps[i] += 1
        kw = dict(lr=hp.learning_rate, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
                  amsgrad=False, maximize=False)
        pieces = [pc for pc in self.pieces if self.params[pc.param].grad is not None]
        resident = [pc for pc in pieces if pc.tier == 0]
        streamed = [pc for pc in pieces if pc.tier == 1]
        # the resident pieces compute in between the streamed ones, while their copies run
        share = math.ceil(len(resident) / (len(streamed) + 1))
        streams = self._streams
        if streams is not None:  # this step's copies in come after the last step's copies out
            streams[0].wait_stream(torch.cuda.current_stream(self.device))
        staged = self._stage(streamed[0], streams) if streamed else None
        for k, piece in enumerate(streamed):
            bufs, ready = staged
            if k + 1 < len(streamed):  # the next piece's state comes in while this one computes
                staged = self._stage(streamed[k + 1], streams)
            for pc in resident[k * share : (k + 1) * share]:
                self._update(pc, self._views(pc), coef, kw)
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            self._update(piece, bufs, coef, kw)
            self._unstage(piece, bufs, streams)
        for pc in resident[len(streamed) * share :]:
            self._update(pc, self._views(pc), coef, kw)
        if streams is not None:
            torch.cuda.current_stream(self.device).wait_stream(streams[1])
        self.zero_grad()
        return {"grad_norm": float(norm)}

    def _update(self, piece: _Piece, bufs: list[torch.Tensor], coef: torch.Tensor, kw: dict) -> None:
        """One fused AdamW update of ``piece`` on its state ``bufs`` (on the device), then the new
        master weights into the parameter."""
        p = self.params[piece.param]
        grad = p.grad.view(-1)[piece.start : piece.start + piece.length].float() * coef
        target = self._flat(piece)
        master = target if self._own_master else bufs[0]
        step = torch.tensor(float(self.steps[piece.param]), device=self.device)
        torch._fused_adamw_([master], [grad], [bufs[-2]], [bufs[-1]], [], [step], **kw)
        if not self._own_master:
            target.copy_(master)

    def _stage(self, piece: _Piece, streams):
        """A streamed piece's state on the device (copies of its views) and the event its copies
        end with (``None``: nothing to wait for)."""
        views = self._views(piece)
        if streams is None:  # a CPU model: the host state is where it computes
            return [v.clone() for v in views], None
        copy_in = streams[0]
        with torch.cuda.stream(copy_in):
            bufs = [v.to(self.device, non_blocking=True) for v in views]
            ready = torch.cuda.Event()
            ready.record(copy_in)
        for b in bufs:
            b.record_stream(torch.cuda.current_stream(self.device))
        return bufs, ready

    def _unstage(self, piece: _Piece, bufs: list[torch.Tensor], streams) -> None:
        views = self._views(piece)
        if streams is None:
            for v, b in zip(views, bufs):
                v.copy_(b)
            return
        copy_out = streams[1]
        copy_out.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(copy_out):
            for v, b in zip(views, bufs):
                v.copy_(b, non_blocking=True)
                b.record_stream(copy_out)

    # -- state ----------------------------------------------------------------------------------

    def _param_state(self, i: int) -> list[torch.Tensor]:
        """Parameter ``i``'s flat ``master, exp_avg, exp_avg_sq`` (its own weights as master when
        it is its own)."""
        tier, lo = self._where_param[i]
        p = self.params[i]
        own = [t[lo : lo + p.numel()] for t in self.state[tier]]
        return ([p.detach().view(-1)] if self._own_master else []) + own

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU fp32 tensors ``{name}.master`` / ``.exp_avg`` / ``.exp_avg_sq`` and ``{name}.step``."""
        if self._streams is not None:
            torch.cuda.synchronize(self.device)
        out = {}
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            for key, t in zip(("master", "exp_avg", "exp_avg_sq"), self._param_state(i)):
                out[f"{name}.{key}"] = t.detach().to("cpu", torch.float32, copy=True).view(p.shape)
            out[f"{name}.step"] = torch.tensor(float(self.steps[i]))
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the state saved by :meth:`state_dict` (and the parameters to its master weights)."""
        want = {f"{n}.{k}" for n in self.names for k in ("master", "exp_avg", "exp_avg_sq", "step")}
        if set(state) != want:
            missing, extra = sorted(want - set(state)), sorted(set(state) - want)
            raise ValueError(f"optimizer state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, p in zip(self.names, self.params):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                if tuple(state[f"{name}.{key}"].shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state {name}.{key} has shape {tuple(state[f'{name}.{key}'].shape)}, "
                                     f"the parameter {tuple(p.shape)}")
        if self._streams is not None:
            torch.cuda.synchronize(self.device)
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            self.steps[i] = int(state[f"{name}.step"])
            for key, t in zip(("master", "exp_avg", "exp_avg_sq"), self._param_state(i)):
                t.copy_(state[f"{name}.{key}"].reshape(-1))
            if not self._own_master:
                p.detach().view(-1).copy_(state[f"{name}.master"].reshape(-1))
