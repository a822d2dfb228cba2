"""The step's plans: one verified plan per input shape, under the whole step's budget."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from remat3d.errors import BudgetError, Remat3dError
from remat3d.planspec import Plan
from remat3d.train.distributed import broadcast_object
from remat3d.units import format_bytes, format_shape, parse_amp

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

__all__ = ["StepPlans"]


class StepPlans:
    """Trainer mixin: the budget accounting of a training step and its plans."""

    def input_shape(self, spatial: Shape, batch: int | None = None) -> Shape:
        return (batch or self.settings.batch_size, self.geometry.in_channels, *spatial)

    def planning_loss(self, shape: Shape) -> Callable[[Any], torch.Tensor]:
        """The training loss against a meta label, so the plan counts what the loss keeps."""
        label = torch.zeros((shape[0], 1, *shape[2:]), dtype=torch.long, device="meta")
        scale = 1.0 / self.settings.accumulate  # as in forward_backward, to the byte
        return lambda output: self.loss_fn(output.float(), label) * scale

    def extra_bytes(self, shape: Shape) -> int:
        """Bytes a training step holds beyond what ``remat3d.plan`` measures (negative: fewer).

        NOTE [ The whole step's budget ]
          ``memory_budget`` is for everything a training step holds on the device; the
          plan is verified on the model's forward and backward from its input, so what the
          step holds besides is added here, and a plan's verified peak plus these bytes is
          the step's verified peak (the one number printed for it, and what the measured
          step peak is compared with):
          - the optimizer state (AdamW: two moments and a step count per trainable weight;
            SGD: one momentum buffer), alive through every step after the first;
          - with ``accumulate`` > 1, the gradients summed so far, alive from the start of
            every micro-batch after the first;
          - DDP: its gradient buckets, allocated once and alive through the whole step;
          - FSDP2: parameters, gradients and optimizer state divided by the world size,
            plus the largest unit's unsharded parameters and gradients in flight; the plan
            measured them whole, so the difference is given back to the step.
          (The batch's label is in the planned step: the planning loss holds a meta label,
          counted from the step's start like the input, ``instrument/step.held_tensors``.)
        """
        weights = [p for p in self.model.parameters() if p.requires_grad]
        trainable = sum(p.numel() * p.element_size() for p in weights)
        if self.settings.optimizer == "adamw":
            optimizer = 2 * trainable + 4 * len(weights)
        else:
            optimizer = trainable
        accumulated = trainable if self.settings.accumulate > 1 else 0
        if self.world.mode == "ddp":
            return optimizer + accumulated + trainable
        if self.world.mode == "fsdp":
            size = self.world.size
            everything = sum(p.numel() * p.element_size() for p in self.model.parameters())
            units = [sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1)
                         for p in child.parameters()) for child in self.model.children()]
            sharded = (everything + trainable) * (size - 1) // size
            return ((optimizer + accumulated) // size
                    - max(0, sharded - max(units, default=0)))
        return optimizer + accumulated

    def verified_step_peak(self, shape: Shape) -> int | None:
        """The step's verified peak (NOTE [ The whole step's budget ]), None without a plan."""
        plan = self.plans.get(shape)
        if plan is None or plan.verified_peak_bytes is None:
            return None
        return plan.verified_peak_bytes + self.extra_bytes(shape)

    def make_plans(self) -> dict[Shape, Plan | None]:
        """One verified plan per distinct input shape; distributed: made on rank 0 and
        broadcast as plain data, so every rank applies the same plan."""
        if not self.world.enabled:
            return self._plan_shapes()
        made: dict[str, Any] = {}
        if self.world.main:
            try:
                made = {"plans": [(k, v.to_dict() if v else None)
                                  for k, v in self._plan_shapes().items()]}
            except Remat3dError as exc:
                made = {"error": str(exc)}
                broadcast_object(made, self.world)
                raise
        made = broadcast_object(made, self.world)
        if "error" in made:
            raise Remat3dError(f"rank 0 could not plan: {made['error']}")
        self.plans = {tuple(k): (Plan.from_dict(v) if v else None) for k, v in made["plans"]}
        return self.plans

    def _plan_shapes(self) -> dict[Shape, Plan | None]:
        """One verified plan per distinct input shape (none if memory_budget is 'none').

        The budget is for the whole step: the planner gets it less :meth:`extra_bytes`, and
        a fraction like ``"0.5x"`` is of the unplanned step including those bytes.
        """
        import remat3d
        from remat3d.planning import resolve_budget

        s = self.settings
        amp = parse_amp(s.amp)
        for spatial in sorted(set(self.step_shapes)):
            shape = self.input_shape(spatial)
            if shape in self.plans:
                continue
            if s.memory_budget.strip().lower() == "none":
                self.plans[shape] = None
                continue
            started = time.perf_counter()
            loss_fn = self.planning_loss(shape)
            extra = self.extra_bytes(shape)
            held = "optimizer state" + (" and summed gradients" if s.accumulate > 1 else "")
            unplanned = remat3d.profile(self.model, shape, amp=amp, loss_fn=loss_fn).peak_bytes
            budget = resolve_budget(s.memory_budget, unplanned + extra)
            if budget <= extra:
                raise BudgetError(
                    f"memory_budget {s.memory_budget!r} ({format_bytes(budget)}) does not even "
                    f"hold the {held} ({format_bytes(extra)}) of a "
                    f"{format_shape(shape)} step; the unplanned step needs "
                    f"{format_bytes(unplanned + extra)}. Raise the budget."
                )
            try:
                # a graph plan replaces the model's forward by one graph: FSDP2 gathers
                # each unit's parameters in its forward hooks, which that graph never
                # calls, so under FSDP2 the plan is of modules
                plan = remat3d.plan(self.model, shape, budget=budget - extra,
                                    strategy=s.strategy, offload=s.offload, amp=amp,
                                    loss_fn=loss_fn, objective=s.objective,
                                    graph=False if self.world.mode == "fsdp" else None)
            except BudgetError as exc:
                raise BudgetError(
                    f"memory_budget {s.memory_budget!r} = {format_bytes(budget)} for the "
                    f"whole step, of which {format_bytes(extra)} is {held}; "
                    f"for the rest: {exc}"
                ) from None
            self.plans[shape] = plan
            tiled = sum(r.decision == "tile" for r in plan.regions)
            what = (f"{len(plan.regions)} regions" + (f" ({tiled} tiled)" if tiled else "")
                    if plan.graph_recompute is None else
                    f"a graph plan, {len(plan.graph_recompute)} graph nodes recomputed")
            self.say(f"plan for {format_shape(shape)} ({s.strategy}): budget "
                     f"{format_bytes(budget)} = {format_bytes(extra)} {held}"
                     f" + {format_bytes(budget - extra)} for the step; {what}; "
                     "verified step peak "
                     f"{format_bytes((plan.verified_peak_bytes or 0) + extra)}"
                     f" (unplanned {format_bytes(unplanned + extra)}); recompute "
                     f"{(plan.recompute_flops or 0) / 1e9:.2f} GFLOP; planned in "
                     f"{time.perf_counter() - started:.1f} s")
        return self.plans

    def use_plan(self, shape: Shape | None) -> None:
        """Install the plan for ``shape`` (``None``: no plan) if another one is in place."""
        import remat3d
        from remat3d.runtime.apply import is_applied

        plan = self.plans.get(shape) if shape is not None else None
        if self._applied == shape and (plan is None) == (not is_applied(self.model)):
            return
        if is_applied(self.model):  # a module plan or a graph plan
            remat3d.remove(self.model)
        if plan is not None:
            remat3d.apply(self.model, plan)
        self._applied = shape
