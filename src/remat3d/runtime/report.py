"""``remat3d.report(model)``: what the applied plan did in the last training step."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from remat3d.errors import Remat3dError
from remat3d.runtime.apply import applied_state
from remat3d.runtime.region import RegionStats
from remat3d.units import format_bytes

__all__ = ["Report", "report"]


@dataclass
class Report:
    """Regions with their forward runs and recomputations; what autograd still saved.

    ``saved_by_module``: bytes autograd saved outside every recompute region during the
    last forward, by the module that saved them (like JAX's ``print_saved_residuals``);
    parameters excluded. Inside recompute regions only the inputs are kept
    (``RegionStats.input_bytes``).
    """

    regions: list[RegionStats]
    saved_by_module: dict[str, int] = field(default_factory=dict)
    host_peak_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved_by_module.values())

    def __str__(self) -> str:
        header = "region                               decision   fwd  recomp  inputs kept"
        lines = [header + "  offloaded"]
        for r in self.regions:
            lines.append(f"{r.label[:36]:36s} {r.decision:9s} {r.forward_runs:4d} "
                         f"{r.recomputes:7d} {format_bytes(r.input_bytes):>12s} "
                         f"{format_bytes(r.offloaded_bytes):>10s}")
        idle = [r.label for r in self.regions if r.forward_runs == 0]
        if idle:
            lines.append(f"warning: {len(idle)} region(s) never ran in the last step: "
                         + ", ".join(idle[:5]))
        lines.append(f"saved outside regions: {format_bytes(self.saved_bytes)}")
        for name, nbytes in sorted(self.saved_by_module.items(), key=lambda kv: -kv[1])[:15]:
            lines.append(f"  {name[:50]:50s} {format_bytes(nbytes):>12s}")
        if self.host_peak_bytes:
            lines.append(f"host memory used by offload (peak): "
                         f"{format_bytes(self.host_peak_bytes)}")
        return "\n".join(lines)


def report(model: nn.Module) -> Report:
    """Report on the last training step of a model with an applied plan."""
    state = applied_state(model)
    if state is None:
        raise Remat3dError("No remat3d plan is applied to this model; nothing to report.")
    return Report(
        regions=[RegionStats(**vars(s)) for s in state.stats.values()],
        saved_by_module=dict(state.saved.by_module),
        host_peak_bytes=state.host.peak_bytes,
    )
