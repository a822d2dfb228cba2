"""Bench suites: which models, sizes, precisions, methods and budgets one run measures.

A suite has three kinds of cases:

- *sweeps* (meta device): every method, remat3d's ``optimal`` at each budget of
  ``budgets``, at its smallest feasible budget, and at the peak each baseline reaches
  (the equal-peak comparison);
- *points* (meta device, up to 512³): the headline methods only — unplanned, blocks,
  torch.compile's budgets, remat3d at its smallest feasible budget with and without
  offload;
- *cpu* (real CPU steps at small sizes): each method's step time against the unplanned
  step (interleaved repeats, median) and its gradients against the unplanned ones
  (bitwise, fp32);
- *blocks* (meta device): checkpointing every block (the MONAI/HF practice), and remat3d
  ``optimal`` at the peak that reaches, by itself and restricted to module plans: how much
  of per-block checkpointing's recomputation the planner saves for the same memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from remat3d.errors import Remat3dError

__all__ = ["SUITES", "Case", "Suite", "budget_bytes", "get_suite", "suite_from_options"]


@dataclass(frozen=True)
class Case:
    model: str
    size: int  # spatial edge, made legal for the model (zoo.legal_shape)
    amp: str  # "none" | "bf16" | "fp16"
    kind: str  # "sweep" | "point" | "cpu" | "blocks"


@dataclass(frozen=True)
class Suite:
    name: str
    sweep_models: tuple[str, ...]
    sweep_sizes: tuple[int, ...]
    sweep_amps: tuple[str, ...]
    point_models: tuple[str, ...]
    point_sizes: tuple[int, ...]
    point_amps: tuple[str, ...]
    cpu_models: tuple[str, ...]
    cpu_sizes: tuple[int, ...]
    budgets: tuple[str, ...]  # remat3d optimal in sweeps, besides smallest and equal peak
    compile_budgets: tuple[float, ...]  # activation_memory_budget values
    cpu_compile_budgets: tuple[float, ...]
    segments: tuple[int, ...]  # checkpoint_sequential
    strategies: tuple[str, ...]  # fixed remat3d strategies besides optimal
    repeats: int  # cpu tier: timed rounds (after one warm-up round)
    offload: tuple[bool, ...] = (False, True)  # remat3d optimal at its smallest budget
    min_seconds: float = 5.0  # cpu tier: short steps get rounds until this much is timed
    max_rounds: int = 60  # cpu tier: at most this many rounds
    model_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # per model
    # cases besides the grids above (the networks too large to sweep)
    extra_cases: tuple[Case, ...] = ()
    blocks_models: tuple[str, ...] = ()  # the blocks kind, fp32 at each of blocks_sizes
    blocks_sizes: tuple[int, ...] = ()

    def cases(self) -> list[Case]:
        out = [Case(m, s, a, "sweep") for m in self.sweep_models for s in self.sweep_sizes
               for a in self.sweep_amps]
        out += [Case(m, s, a, "point") for m in self.point_models for s in self.point_sizes
                for a in self.point_amps]
        out += [Case(m, s, "none", "cpu") for m in self.cpu_models for s in self.cpu_sizes]
        out += [Case(m, s, "none", "blocks") for m in self.blocks_models
                for s in self.blocks_sizes]
        return out + list(self.extra_cases)

    def override(self, *, models: list[str] | None = None, sizes: list[int] | None = None,
                 budgets: list[str] | None = None) -> Suite:
        """The suite with its models (every kind), point sizes, or sweep budgets replaced."""
        changes: dict[str, object] = {}
        if models:
            changes.update(sweep_models=tuple(models), point_models=tuple(models),
                           cpu_models=tuple(models), extra_cases=())
            if self.blocks_models:
                changes["blocks_models"] = tuple(models)
        if sizes:
            if any(s <= 0 for s in sizes):
                raise Remat3dError(f"Sizes must be positive spatial edges, got {sizes}.")
            changes["point_sizes"] = tuple(sizes)
        if budgets:
            changes["budgets"] = tuple(budgets)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


QUICK = Suite(
    name="quick",
    sweep_models=("nnunet",), sweep_sizes=(128,), sweep_amps=("none",),
    point_models=("nnunet",), point_sizes=(512,), point_amps=("bf16",),
    cpu_models=("unet",), cpu_sizes=(32,),
    budgets=("0.9x", "0.8x"),
    compile_budgets=(1.0, 0.5, 0.1),
    cpu_compile_budgets=(0.5,),
    segments=(2,),
    strategies=("blocks",),
    repeats=3,
)

FULL = Suite(
    name="full",
    sweep_models=("nnunet", "unet", "basicunet"), sweep_sizes=(128,),
    sweep_amps=("none",),
    point_models=("nnunet",), point_sizes=(128, 256, 512), point_amps=("bf16",),
    cpu_models=("nnunet", "unet", "segresnet"), cpu_sizes=(32,),  # nnunet: 64 (its minimum)
    budgets=("0.9x", "0.8x", "0.7x"),
    compile_budgets=(1.0, 0.7, 0.5, 0.3, 0.0),
    cpu_compile_budgets=(0.5,),
    segments=(2, 4),
    strategies=("blocks", "sqrt", "selective"),
    repeats=5,
    # nnU-Net v2's own networks (dynamic-network-architectures), where issue 18 measures
    extra_cases=(Case("nnunetv2", 512, "bf16", "point"), Case("resenc-l", 512, "bf16", "point")),
)

# for tests and a first look: seconds on two cores (a two-level SegResNet, 4 filters)
TINY = Suite(
    name="tiny",
    sweep_models=("segresnet",), sweep_sizes=(16,), sweep_amps=("none",),
    point_models=("segresnet",), point_sizes=(8, 16), point_amps=("none",),
    cpu_models=("segresnet",), cpu_sizes=(16,),  # the sweep's size: its plans are reused
    budgets=("0.9x",),
    compile_budgets=(),
    cpu_compile_budgets=(),
    segments=(2,),
    strategies=("blocks",),
    repeats=2,
    offload=(False,),
    min_seconds=0.0,
    model_kwargs={"segresnet": {"init_filters": 4, "blocks_down": (1, 1), "blocks_up": (1,),
                                "norm": ("GROUP", {"num_groups": 2})}},
)

_ATTENTION_UNET = "monai.networks.nets:AttentionUnet"
_VNET = "monai.networks.nets:VNet"

# at per-block checkpointing's peak, on every zoo preset and two MONAI networks outside it
# (issue 18's acceptance 3); minutes on two cores
BLOCKS = Suite(
    name="blocks",
    sweep_models=(), sweep_sizes=(), sweep_amps=(),
    point_models=(), point_sizes=(), point_amps=(),
    cpu_models=(), cpu_sizes=(),
    budgets=(), compile_budgets=(), cpu_compile_budgets=(), segments=(), strategies=(),
    repeats=1,
    blocks_models=("nnunet", "unet", "basicunet", "segresnet", "swinunetr", "unetr",
                   "resnet3d", "revunet", "nnunetv2", "resenc-l", _ATTENTION_UNET, _VNET),
    blocks_sizes=(128,),
    model_kwargs={_ATTENTION_UNET: {"spatial_dims": 3, "in_channels": 1, "out_channels": 2,
                                    "channels": [16, 32, 64, 128], "strides": [2, 2, 2]},
                  _VNET: {"spatial_dims": 3, "in_channels": 1, "out_channels": 2}},
)

# the cpu tier alone, with rounds enough to tell a few per cent apart: per-block
# checkpointing's time, torch's against remat3d's (issue 19: within 5 %); minutes
CPU = Suite(
    name="cpu",
    sweep_models=(), sweep_sizes=(), sweep_amps=(),
    point_models=(), point_sizes=(), point_amps=(),
    cpu_models=("nnunet", "unet", "segresnet"), cpu_sizes=(32,),  # nnunet: 64 (its minimum)
    budgets=(), compile_budgets=(), cpu_compile_budgets=(), segments=(),
    strategies=("blocks",),
    repeats=9,
    offload=(False,),
    min_seconds=30.0,
    max_rounds=400,
)

SUITES = {s.name: s for s in (QUICK, FULL, TINY, BLOCKS, CPU)}


def get_suite(name: str) -> Suite:
    try:
        return SUITES[name]
    except KeyError:
        raise Remat3dError(
            f"Unknown bench suite {name!r}; use one of {', '.join(SUITES)}."
        ) from None


def budget_bytes(budget: str, unplanned_peak: int) -> int:
    """A sweep budget in bytes: ``"0.8x"`` of the unplanned peak, or a size (``"3GiB"``).

    >>> budget_bytes("0.5x", 1000), budget_bytes("1KiB", 1000)
    (500, 1024)
    """
    from remat3d.units import parse_bytes

    text = budget.strip().lower()
    if text.endswith("x"):
        try:
            fraction = float(text[:-1])
        except ValueError:
            fraction = -1.0
        if not 0 < fraction:
            raise Remat3dError(f"Cannot read budget {budget!r}: a fraction of the unplanned "
                               "peak is written like '0.8x' (positive).")
        return int(unplanned_peak * fraction)
    return parse_bytes(budget)


def _items(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def suite_from_options(name: str, models: str | None = None, sizes: str | None = None,
                       budgets: str | None = None) -> Suite:
    """The named suite with comma-separated overrides, checked before any work.

    >>> suite_from_options("quick", sizes="128,256").point_sizes
    (128, 256)
    >>> suite_from_options("quick", sizes="big")
    Traceback (most recent call last):
    ...
    remat3d.errors.Remat3dError: Cannot read --sizes 'big': give spatial edges like 128,256,512.
    """
    from remat3d.bench.methods import check_model

    suite = get_suite(name)
    model_list = _items(models)
    for model in model_list:
        check_model(model)  # unknown names fail here, with a suggestion
    try:
        size_list = [int(s) for s in _items(sizes)]
    except ValueError:
        raise Remat3dError(f"Cannot read --sizes {sizes!r}: give spatial edges like "
                           "128,256,512.") from None
    budget_list = _items(budgets)
    for budget in budget_list:
        budget_bytes(budget, 1)
    return suite.override(models=model_list or None, sizes=size_list or None,
                          budgets=budget_list or None)
