"""The run: epochs of steps, validation, state files and exact resume, the weights."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from remat3d.errors import SettingsError
from remat3d.graph import atomic_write_text
from remat3d.planspec import Plan
from remat3d.train.distributed import barrier
from remat3d.train.state import (
    STATE_FILE,
    check_resumable,
    load_state,
    rng_state,
    save_state,
    set_rng_state,
)
from remat3d.units import format_bytes

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

__all__ = ["Fitting", "Interrupted", "TrainResult"]


class Interrupted(Exception):
    """Raised by ``interrupt_after``: stands in for a killed process in tests."""


@dataclass
class TrainResult:
    output_dir: Path
    epochs: int
    steps: int                                   # optimizer steps
    losses: list[float] = field(default_factory=list)           # per micro-batch
    validation: list[dict[str, Any]] = field(default_factory=list)
    peaks: dict[Shape, int] = field(default_factory=dict)       # measured, per input shape
    plans: dict[Shape, Plan] = field(default_factory=dict)
    # per input shape, the plan's verified peak plus what the step holds besides
    # (NOTE [ The whole step's budget ] in plans.py): what ``peaks`` is compared with
    verified_peaks: dict[Shape, int] = field(default_factory=dict)


@dataclass
class _Position:
    """Where a run is: epoch, batch in the epoch, optimizer steps, and its log."""

    log: _Log
    per_step: int  # volumes per global batch
    epoch: int = 0
    position: int = 0
    step: int = 0


class Fitting:
    """Trainer mixin: the run itself, and the full state dicts it saves and loads."""

    def _world_mean(self, value: float) -> float:
        if not self.world.enabled:
            return value
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) / self.world.size

    def _states(self, optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Full (unsharded) model and optimizer state dicts; under FSDP2 a collective that
        every rank must enter (rank 0 receives the full tensors, on the CPU)."""
        if self.world.mode != "fsdp":
            return (self.model.state_dict(),
                    self.optimizer.state_dict() if optimizer else None)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = (get_optimizer_state_dict(self.model, self.optimizer, options=options)
                           if optimizer else None)
        return model_state, optimizer_state

    def _load_states(self, state: dict[str, Any]) -> None:
        # a state saved under FSDP2 names optimizer entries by parameter (strings), a plain
        # one by position: each is loaded by the API that wrote it
        by_name = any(isinstance(k, str) for k in state["optimizer"].get("state", {}))
        if self.world.mode == "fsdp" or by_name:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"], options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=options)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def fit(self, *, resume: bool = False, overwrite: bool = False,
            interrupt_after: int | None = None) -> TrainResult:
        """Run the epochs (from the last state file with ``resume``); NOTE [ Exact resume ]
        in ``state.py`` says what a resumed run repeats exactly. A new run refuses an
        ``output_dir`` that holds a run unless ``overwrite``."""
        s = self.settings
        self.model.train()
        run = _Position(_Log(self.output_dir / "log.jsonl", writes=self.world.main),
                        per_step=s.batch_size * self.world.size)
        if not resume and not overwrite:
            _refuse_a_finished_run(self.output_dir)
        self.make_plans()  # before anything is written: an infeasible budget leaves no files
        if resume:
            self._resume(run)
        else:
            self._start(run)
        result = TrainResult(self.output_dir, run.epoch, run.step,
                             plans={k: v for k, v in self.plans.items() if v is not None})
        for record in run.log.records():  # a resumed run reports the validations it kept
            if record.get("event") == "validation":
                result.validation.append({k: v for k, v in record.items()
                                          if k not in ("event", "step")})
        while run.epoch < s.epochs:
            self._epoch(run, result, interrupt_after)
            run.epoch, run.position = run.epoch + 1, 0
            if self.val_set is not None and (run.epoch % s.val_every == 0
                                             or run.epoch == s.epochs):
                metrics = self.validate()
                run.log.write({"event": "validation", "epoch": run.epoch, "step": run.step,
                               **metrics})
                result.validation.append({"epoch": run.epoch, **metrics})
                self.say(f"epoch {run.epoch}: validation Dice {metrics['dice']:.4f}")
            self._save(run)
        self.use_plan(None)
        self.sync_buffers()
        model_state, _ = self._states(optimizer=False)
        if self.world.main:
            _save_weights(self.output_dir / "model.pt", model_state)
        barrier(self.world)
        result.epochs, result.steps = run.epoch, run.step
        result.peaks = dict(self.peaks)
        result.verified_peaks = {shape: peak for shape in result.plans
                                 if (peak := self.verified_step_peak(shape)) is not None}
        return result

    def _start(self, run: _Position) -> None:
        if self.world.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            import yaml

            atomic_write_text(self.output_dir / "settings.yaml",
                              yaml.safe_dump(self.settings.to_dict(), sort_keys=False))
        run.log.truncate(0)

    def _resume(self, run: _Position) -> None:
        state = load_state(self.output_dir)
        check_resumable(state["settings"], self.settings.to_dict())
        self._load_states(state)
        set_rng_state(state["rng"])
        run.epoch, run.step = state["epoch"], state["step"]
        # volumes consumed in the epoch: a resume may use another world size
        run.position = state.get("volumes", state["position"]) // run.per_step
        run.log.truncate(state["log_lines"])
        self.say(f"resuming {self.output_dir} at epoch {run.epoch + 1}, step {run.step}")

    def _epoch(self, run: _Position, result: TrainResult, interrupt_after: int | None) -> None:
        """The rest of epoch ``run.epoch``, from batch ``run.position``."""
        s = self.settings
        batches = self.batches(run.epoch)
        bar = _progress(len(batches), f"epoch {run.epoch + 1}/{s.epochs}",
                        s.progress and self.world.main, initial=run.position)
        pending = 0  # micro-batches accumulated since the last optimizer step
        for index in range(run.position, len(batches)):
            sample = self.load_batch(batches[index], run.epoch)
            shape = tuple(sample.image.shape)
            self.use_plan(shape)
            started = time.perf_counter()
            last = index == len(batches) - 1
            loss = self.forward_backward(sample, scale=1.0 / s.accumulate,
                                         sync=pending + 1 == s.accumulate or last)
            loss = self._world_mean(loss)  # what the step averaged over
            pending += 1
            result.losses.append(loss)
            if pending == s.accumulate or last:
                self.optimizer_step()
                pending = 0
                run.step += 1
            run.log.write({"event": "step", "epoch": run.epoch + 1, "batch": index + 1,
                           "step": run.step, "loss": loss, "volume": sample.name,
                           "shape": list(shape), "peak_bytes": self.peaks.get(shape),
                           "seconds": round(time.perf_counter() - started, 4)})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}",
                            peak=format_bytes(self.peaks[shape]) if shape in self.peaks
                            else "?")
            if pending == 0 and not last and run.step % s.save_every == 0:
                self._save(run, position=index + 1)
            if pending == 0 and interrupt_after is not None and run.step >= interrupt_after:
                bar.close()
                raise Interrupted(f"interrupted after optimizer step {run.step}")
        bar.close()

    def _save(self, run: _Position, position: int = 0) -> None:
        """The training-state file at batch ``position`` of epoch ``run.epoch``."""
        self.sync_buffers()
        model_state, optimizer_state = self._states()  # collective under FSDP
        if self.world.main:
            save_state(self.output_dir, {
                "settings": self.settings.to_dict(), "epoch": run.epoch, "position": position,
                "volumes": position * run.per_step, "world_size": self.world.size,
                "step": run.step, "model": model_state, "optimizer": optimizer_state,
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "rng": rng_state(), "log_lines": run.log.lines,
            })
        barrier(self.world)


# --------------------------------------------------------------------------- helpers


class _Log:
    """The JSON-lines log; on resume it is cut back to the lines the state file knew.
    Only rank 0 writes (``writes=False`` elsewhere), every rank counts lines."""

    def __init__(self, path: Path, writes: bool = True) -> None:
        self.path = path
        self.lines = 0
        self.writes = writes

    def truncate(self, lines: int) -> None:
        kept = self.path.read_text().splitlines()[:lines] if self.path.exists() else []
        if self.writes:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self.lines = len(kept)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def write(self, record: dict[str, Any]) -> None:
        if self.writes:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        self.lines += 1


def _progress(total: int, desc: str, enabled: bool, initial: int = 0) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, initial=initial, leave=False,
                dynamic_ncols=True)


def _save_weights(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


_RUN_FILES = ("model.pt", STATE_FILE, "log.jsonl", "settings.yaml")


def _refuse_a_finished_run(output_dir: Path) -> None:
    """A new run must not overwrite the weights, state and log of an earlier one."""
    found = [name for name in _RUN_FILES if (output_dir / name).exists()]
    if found:
        raise SettingsError(
            f"output_dir {str(output_dir)!r} already holds a run ({', '.join(found)}). "
            "Continue it with --resume (resume=True), start it again from scratch with "
            "--overwrite (overwrite=True), or choose another output_dir."
        )

