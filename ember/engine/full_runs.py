"""Full fine-tuning runs of one engine, and the samplers that read their weights.

A client asks for full fine-tuning with ``create_lora_training_client(base_model, rank=0)`` on a
model served with ``--full-finetune``. Each run holds its own trainable copy of the base model
(:func:`~ember.core.full_ft.clone_for_training`: the weights other tenants read are never
changed), its :class:`~ember.core.offload.MasterAdamW` (fp32 master weights and moments on the
device, in host memory or on disk: ``--optimizer-offload``) and an empty adapter bank (what the
packed pass and the sampler read: no LoRA). How many runs an engine holds is decided by memory:
a run is created only when its weights, gradients and on-device optimizer state fit
(:func:`run_bytes`), else the request fails with :class:`NoRoom` (a clear error; nothing changes).

Ids: runs and their samplers live beside the adapter bank under negative ids (slot 0 is the base
model, positive slots are LoRA adapters), so the service keeps one ``model id -> slot`` map.

Samplers of a run (:class:`FullSampler`) never copy weights while they can read the run's own:

* made at the run's current version (``save_weights_and_get_sampling_client``, or a sampler over
  a checkpoint the run just wrote) they read the run's model directly;
* when the run moves on (``optim_step``, a load), a sampler over a checkpoint goes back to its
  folder, and a snapshot without one keeps a host copy of the weights it saw; at most
  :data:`HOST_SNAPSHOTS` such copies per run are kept (the SDK never releases a sampler, and an RL
  loop makes one per step), an older snapshot fails with a clear error when it is used again;
* a sampler that no longer reads the run gets a frozen model on the device when it samples,
  built from its folder or host copy (one at a time, released before another is built).
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember.core.adapters import AdapterBank, AdapterBankFull
from ember.core.checkpointing import apply_checkpointing, available_bytes
from ember.core.full_checkpoint import load_full, save_full
from ember.core.full_ft import clone_for_training, trainable_parameters
from ember.core.models.base import CausalLM
from ember.core.offload import MasterAdamW, host_available_bytes
from ember.core.optim import AdamParams

log = logging.getLogger("ember.engine.full_runs")

HOST_SNAPSHOTS = 2  # host copies of superseded weights kept per run for snapshot samplers
FIT_FRACTION = 0.9  # a run is created only if it needs at most this fraction of the free memory


class NoRoom(AdapterBankFull):
    """The engine has no memory for another full fine-tuning run or frozen sampler copy."""


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights full fine-tuning trains (what a copy of them takes)."""
    return sum(p.numel() * p.element_size() for _, p in trainable_parameters(model))


def run_bytes(model: CausalLM, offload: str, device_bytes: int = 0) -> int:
    """Device bytes a new run of ``model`` takes: its weights and their gradients in the model
    dtype, and the optimizer's fp32 moments and master weights on the device (all of them with
    ``none``, else at most ``device_bytes``)."""
    state = sum((8 if p.dtype == torch.float32 else 12) * p.numel() for _, p in trainable_parameters(model))
    return 2 * weight_bytes(model) + (state if offload == "none" else min(state, device_bytes))


def free_bytes(device: torch.device) -> int:
    return available_bytes(device) if device.type == "cuda" else host_available_bytes()


@dataclass
class FullRun:
    """One run: its model, trainable names, optimizer, and how many times its weights changed."""

    model: CausalLM
    names: list[str]
    optimizer: MasterAdamW
    bank: AdapterBank
    checkpointing: object | None
    token: str = field(default_factory=lambda: secrets.token_hex(8))  # names this run in its checkpoints
    version: int = 0
    snapshots: list[int] = field(default_factory=list)  # its host-copy snapshot samplers, oldest first

    def tensors(self) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        return {n: params[n] for n in self.names}


@dataclass
class FullSampler:
    """A sampler of full fine-tuned weights: the run's at ``version`` while it is there, else a
    checkpoint ``folder``, else a ``host`` copy (``None`` for all three: superseded and dropped)."""

    run: int | None
    version: int
    folder: Path | None = None
    host: dict[str, torch.Tensor] | None = None
    gone: bool = False


@dataclass
class Weights:
    """What a pass or a sampler runs on: a model and its adapter bank."""

    model: CausalLM
    bank: AdapterBank
    checkpointing: object | None = None


class FullRuns:
    """The full fine-tuning runs and full-weights samplers of one worker (see the module doc)."""

    def __init__(self, base: CausalLM, offload: str = "none", checkpointing: bool = True, device_bytes: int = 0):
        self.base = base
        self.offload = offload
        self.device_bytes = device_bytes  # optimizer state kept on the device anyway (host, disk)
        self.checkpointing = checkpointing
        self.runs: dict[int, FullRun] = {}
        self.samplers: dict[int, FullSampler] = {}
        self._next = -1
        self._frozen: tuple[int, Weights] | None = None  # the one frozen sampler model on the device
        self._scratch: tempfile.TemporaryDirectory | None = None  # copies of non-local sampler folders

    def _new_id(self) -> int:
        i, self._next = self._next, self._next - 1
        return i

    @property
    def device(self) -> torch.device:
        return self.base.model.embed_tokens.weight.device

    def _check_room(self, need: int, what: str) -> None:
        free = free_bytes(self.device)
        if need > FIT_FRACTION * free and self._frozen is not None:
            self._release_frozen()
            free = free_bytes(self.device)
        if need > FIT_FRACTION * free:
            raise NoRoom(f"no memory for {what}: it needs {need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB "
                         f"is free on {self.device} ({len(self.runs)} full fine-tuning runs are loaded)")

    # -- runs ---------------------------------------------------------------------------------------

    def create(self) -> int:
        """A new run over the base model's current weights; returns its id."""
        self._check_room(run_bytes(self.base, self.offload, self.device_bytes), "another full fine-tuning run")
        model = clone_for_training(self.base)
        params = trainable_parameters(model)
        optimizer = MasterAdamW(params, self.offload, device_budget_bytes=self.device_bytes)
        run = FullRun(model, [n for n, _ in params], optimizer, AdapterBank(model, max_adapters=1, max_rank=1),
                      apply_checkpointing(model) if self.checkpointing else None)
        i = self._new_id()
        self.runs[i] = run
        log.info("full fine-tuning run created", extra={"id": i, "parameters": sum(p.numel() for _, p in params),
                                                        "offload": self.offload})
        return i

    def get(self, i: int) -> FullRun:
        run = self.runs.get(i)
        if run is None:
            raise KeyError(f"no full fine-tuning run {i}")
        return run

    def weights(self, i: int) -> Weights:
        """What a training pass of run ``i`` runs on."""
        run = self.get(i)
        return Weights(run.model, run.bank, run.checkpointing)

    def step(self, i: int, params: AdamParams) -> dict[str, float]:
        run = self.get(i)
        self._superseding(i, run)
        metrics = run.optimizer.step(params)
        run.version += 1
        return metrics

    def save(self, i: int, path: Path, with_optimizer: bool, metadata: dict, overwrite: bool = False) -> Path:
        run = self.get(i)
        meta = {**metadata, "run": {"token": run.token, "version": run.version}}
        state = run.optimizer.state_dict() if with_optimizer else None
        return save_full(run.model, path, run.names, state, meta, overwrite)

    def load(self, path: Path, with_optimizer: bool) -> int:
        """A new run with the weights (and optimizer state) of a full checkpoint."""
        i = self.create()
        run = self.runs[i]
        try:
            state = load_full(run.model, path, run.names, with_optimizer)
            if state is not None:
                run.optimizer.load_state_dict(state)
        except BaseException:
            self.free(i)
            raise
        return i

    def free(self, i: int) -> None:
        """Drop a run or a sampler (a run's samplers keep what they need: folder or host copy)."""
        if i in self.samplers:
            self.samplers.pop(i)
            if self._frozen is not None and self._frozen[0] == i:
                self._release_frozen()
            return
        run = self.runs.get(i)
        if run is None:
            return
        self._superseding(i, run)
        for s in self.samplers.values():
            if s.run == i:
                s.run = None
        run.optimizer.close()
        del self.runs[i]

    def _superseding(self, i: int, run: FullRun) -> None:
        """Run ``i``'s weights are about to change: its samplers at the current version stop
        reading them (a checkpoint folder, or a host copy; see the module doc)."""
        current = [(j, s) for j, s in self.samplers.items() if s.run == i and s.version == run.version]
        if any(s.folder is None for _, s in current):
            host = {n: t.detach().to("cpu", copy=True) for n, t in run.tensors().items()}
        for j, s in current:
            s.run = None
            if s.folder is None:
                s.host = host
                run.snapshots.append(j)
        while len(run.snapshots) > HOST_SNAPSHOTS:
            old = self.samplers.get(run.snapshots.pop(0))
            if old is not None and old.host is not None:
                old.host, old.gone = None, True

    # -- samplers -----------------------------------------------------------------------------------

    def snapshot(self, i: int) -> int:
        """A sampler of run ``i``'s current weights (``save_weights_and_get_sampling_client``)."""
        run = self.get(i)
        j = self._new_id()
        self.samplers[j] = FullSampler(run=i, version=run.version)
        return j

    def load_sampler(self, path: Path, persistent: bool) -> int:
        """A sampler of a full checkpoint folder: the run that wrote it while it still has those
        weights, else the folder (copied to a scratch folder unless ``persistent``)."""
        meta = _metadata(path)
        token, version = meta.get("run", {}).get("token"), meta.get("run", {}).get("version")
        if not persistent:
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="ember-full-samplers-")
            dest = Path(self._scratch.name) / secrets.token_hex(6)
            shutil.copytree(path, dest)
            path = dest
        j = self._new_id()
        owner = next((i for i, r in self.runs.items() if r.token == token and r.version == version), None)
        self.samplers[j] = FullSampler(run=owner, version=version if owner is not None else -1, folder=Path(path))
        return j

    def sampler_weights(self, j: int) -> tuple[Weights, tuple]:
        """What sampler ``j`` samples from, and a key that changes whenever those weights change
        (the engine keeps one sampling engine per key)."""
        s = self.samplers.get(j)
        if s is None:
            raise KeyError(f"no full-weights sampler {j}")
        if s.run is not None:
            run = self.runs[s.run]
            return Weights(run.model, run.bank), ("run", s.run, run.version)
        if s.gone:
            raise ValueError("this sampler's weights were superseded by later optimizer steps and are no longer "
                             f"kept (full fine-tuning keeps host copies of the last {HOST_SNAPSHOTS} per run); "
                             "use save_weights_for_sampler(name) for a sampler that outlives training")
        if self._frozen is None or self._frozen[0] != j:
            self._release_frozen()
            self._check_room(weight_bytes(self.base), "a sampler's frozen copy of the weights")
            model = clone_for_training(self.base)
            names = [n for n, _ in trainable_parameters(model)]
            if s.host is not None:
                params = dict(model.named_parameters())
                with torch.no_grad():
                    for n in names:
                        params[n].copy_(s.host[n])
            else:
                load_full(model, s.folder, names, with_optimizer=False)
            model.requires_grad_(False)
            self._frozen = (j, Weights(model, AdapterBank(model, max_adapters=1, max_rank=1)))
        return self._frozen[1], ("frozen", j)

    def _release_frozen(self) -> None:
        self._frozen = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        for i in list(self.runs):
            self.free(i)
        if self._scratch is not None:
            self._scratch.cleanup()


def _metadata(path: Path) -> dict:
    return json.loads((Path(path) / "metadata.json").read_text())
