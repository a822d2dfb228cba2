"""Plan: what to recompute, offload or store in lower precision — plain, versioned data.

A plan names regions of a model by module qualified name (and, optionally, which calls of
that module), never by Python object, so it can be saved, inspected, diffed and applied to
a freshly built model. It imports no torch.

>>> plan = Plan(regions=[Region("encoder.0"), Region("decoder", decision="offload")])
>>> Plan.from_dict(plan.to_dict()) == plan
True
>>> print(plan.summary().splitlines()[0])
remat3d plan: 2 regions (1 recompute, 1 offload)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from remat3d.decisions import PLAN_DECISIONS, Decision
from remat3d.errors import PlanError
from remat3d.graph import atomic_write_text
from remat3d.units import format_bytes, format_shape

__all__ = ["DECISIONS", "GRAPH_BACKENDS", "OBJECTIVES", "PLAN_SCHEMA", "GraphTiling", "Plan",
           "PlanError", "Region"]

PLAN_SCHEMA = "remat3d.plan/1"
# how a graph plan's graphs run: "eager" op by op (bitwise eager), "inductor" compiled
# (runtime/inductor.py)
GRAPH_BACKENDS = ("eager", "inductor")
# what a plan minimises (planner/optimal.py Costs.objective)
OBJECTIVES = ("time", "flops")
DECISIONS = tuple(d.value for d in PLAN_DECISIONS)  # what Region.decision may say
STASHES = ("none", "sums", "inputs", "all")  # what a graph plan's tiled regions stash (GraphTiling)


@dataclass(frozen=True)
class GraphTiling:
    """How a graph plan tiles (``runtime/tiled_graph.py``): the ops of its ``levels``
    finest grids run in tiled regions of tiles ``tile`` (on the finest grid), each region
    stashing (``planner/graph_tiles.py`` NOTE rule 6) what ``stash`` says of what a later
    pass reads: ``"none"``, ``"sums"`` (what a reduce sums: a normalisation's input, the
    gradient its backward sums), ``"inputs"`` (every spatial input of a reduce) or
    ``"all"``, per region where ``stashes`` names it; and computing again what an earlier
    region made instead of reading it whole when ``copy`` (rule 7)."""

    tile: tuple[int, int, int]
    levels: int = 1
    stash: str = "none"  # one of STASHES
    copy: bool = False  # later regions compute again what earlier ones made (rule 7)
    # per region (its label: "forward:<node>" / "backward:<node>", the node its last
    # member), a stash other than ``stash``
    stashes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stashes", tuple(sorted(
            (str(k), str(v)) for k, v in (self.stashes.items() if isinstance(self.stashes, dict)
                                          else self.stashes))))
        for policy in (self.stash, *(v for _, v in self.stashes)):
            if policy not in STASHES:
                raise PlanError(f"graph_tiling stash {policy!r}: one of "
                                f"{', '.join(map(repr, STASHES))}.")
        tile = tuple(int(t) for t in self.tile)
        object.__setattr__(self, "tile", tile)
        if len(tile) != 3 or min(tile) < 1:
            raise PlanError(f"graph_tiling.tile is {list(self.tile)}; a tile is three edges "
                            "of at least one voxel, [D, H, W].")
        if self.levels < 1:
            raise PlanError(f"graph_tiling.levels is {self.levels}; at least the finest "
                            "grid (1) is tiled.")
        if any(t % 2 ** (self.levels - 1) for t in tile):
            raise PlanError(f"graph_tiling.tile {list(tile)} tiles {self.levels} grids: each "
                            f"edge must be a multiple of {2 ** (self.levels - 1)} so that "
                            "tiles of the coarser grids line up.")


@dataclass
class Region:
    """One region of the model whose saved activations are handled differently.

    Attributes:
        module: qualified name of the module ("" is the whole model).
        calls: which invocations of that module in one forward (0-based); ``None``: all.
        segment: for an ``nn.Sequential``, the names of a contiguous run of its children
            that forms the region (``["2", "3", "4"]``); ``None``: the whole module.
        decision: ``"recompute"`` (checkpoint: keep only the inputs, recompute in backward),
            ``"offload"`` (run normally, move saved tensors to host memory), ``"keep"``
            (run normally; only meaningful with ``storage_dtype``), or ``"tile"`` (run the
            module tile by tile over its output volume, keeping only its inputs:
            ``remat3d.tile``; the module must be spatially local, see docs/tiling.md).
        policy: op-level policy inside a recompute region: ``"recompute-all"`` (default),
            ``"save-compute-heavy"``, ``"save-norm-and-pool"``, or a list of aten op names
            to keep (``["convolution", "mm"]``).
        storage_dtype: store saved tensors of an offload/keep region in this dtype
            (``"bfloat16"``): halves their bytes, and is the one choice that changes the
            gradients (rounding), so it is never made unless asked for.
        tile: output tile edge of a ``"tile"`` region: ``[D, H, W]`` (or one edge for
            all three axes); tiles need not divide the volume.
        fuse: a ``"tile"`` region whose output is never stored: tiled regions that read it
            compute it inside their own tiles, anything else computes it once when it
            first needs it (NOTE [ Fused tiled regions ] in ``runtime/tiling/fused.py``).
        host: a ``"tile"`` region whose output (and its gradient) lives in host memory:
            tiled regions that read it copy their tiles' slices to the device, anything
            else copies it to the device when it first needs it (NOTE [ Host-resident
            tiled outputs ] in ``runtime/tiling/host.py``).
        stash: a ``"tile"`` region whose normalisations' inputs are kept whole while the
            passes that read them run, on the ``"device"`` or in ``"host"`` memory, so
            that each pass starts from the last one instead of recomputing from the
            region's inputs (NOTE [ Stashed passes ] in ``runtime/tiling/tiled.py``):
            fewer FLOPs for more memory. ``None``: every pass starts from the inputs.
        stash_norms: with ``stash``, which normalisations keep their inputs, by their
            order in the region's run (0 the first; a fused producer's come first);
            ``None``: every one that may.
        rebuild: a ``"tile"`` region whose output its tiled readers do not keep for their
            backward: each of those backwards runs the region's forward again (NOTE
            [ Rebuilt tiled outputs ] in ``runtime/tiling/tiled.py``): one forward more
            per reader, the output whole only inside their backwards.
        hand_inputs: with ``rebuild``, the last reader's rebuild hands the inputs it
            rebuilt (rebuilt outputs of other regions) to this region's own backward
            instead of letting them go (rule 6 of the same NOTE): one rebuild fewer.
        rebuild_in_tiles: a ``"tile"`` region whose backward (and each rebuild of it)
            never makes the rebuilt outputs it reads (other regions' ``rebuild``) whole:
            each of its tiles computes the part it reads (rule 7 of the same NOTE): those
            outputs absent from its backward too, for their ops once per pass of it.
    """

    module: str
    calls: list[int] | None = None
    segment: list[str] | None = None
    decision: str = "recompute"
    policy: str | list[str] | None = None
    storage_dtype: str | None = None
    tile: list[int] | None = None
    fuse: bool = False
    host: bool = False
    stash: str | None = None
    stash_norms: list[int] | None = None
    rebuild: bool = False
    hand_inputs: bool = False
    rebuild_in_tiles: bool = False

    @property
    def label(self) -> str:
        name = self.module or "(model)"
        if self.segment:
            name += f"[{self.segment[0]}..{self.segment[-1]}]"
        if self.calls is not None:
            name += "#" + ",".join(map(str, self.calls))
        return name

    def check(self) -> None:
        if self.decision not in DECISIONS:
            raise PlanError(
                f"Region {self.label}: unknown decision {self.decision!r}; "
                f"use one of {', '.join(DECISIONS)}."
            )
        self.decision = Decision(self.decision).value  # plain JSON text, member or not
        if self.policy is not None and self.decision != Decision.RECOMPUTE:
            raise PlanError(
                f"Region {self.label}: an op policy only applies to decision 'recompute', "
                f"not {self.decision!r}."
            )
        if (self.decision == Decision.TILE) != (self.tile is not None):
            raise PlanError(
                f"Region {self.label}: decision 'tile' needs a tile size and a tile size "
                f"needs decision 'tile'; got decision {self.decision!r}, tile {self.tile!r}."
            )
        if self.tile is not None and (
                len(self.tile) not in (1, 3)
                or any(not isinstance(t, int) or t < 1 for t in self.tile)):
            raise PlanError(
                f"Region {self.label}: tile must be one or three positive ints (D, H, W), "
                f"got {self.tile!r}."
            )
        if self.fuse and self.decision != Decision.TILE:
            raise PlanError(f"Region {self.label}: fuse applies to tiled regions only "
                            f"(decision 'tile'), not {self.decision!r}.")
        if self.host and (self.decision != Decision.TILE or self.fuse):
            raise PlanError(f"Region {self.label}: host applies to tiled regions that are "
                            f"not fused (decision 'tile', fuse False); got decision "
                            f"{self.decision!r}, fuse {self.fuse}.")
        if self.rebuild and (self.decision != Decision.TILE or self.fuse or self.host):
            raise PlanError(f"Region {self.label}: rebuild applies to tiled regions whose "
                            f"output is stored on the device (decision 'tile', neither fuse "
                            f"nor host); got decision {self.decision!r}, fuse {self.fuse}, "
                            f"host {self.host}.")
        if self.hand_inputs and not self.rebuild:
            raise PlanError(f"Region {self.label}: hand_inputs applies to rebuilt tiled "
                            f"regions (rebuild True) only.")
        if self.rebuild_in_tiles and (self.decision != Decision.TILE or self.fuse
                                      or self.host):
            raise PlanError(f"Region {self.label}: rebuild_in_tiles applies to tiled "
                            f"regions that are not fused nor host (their readers run "
                            f"them); got decision {self.decision!r}, fuse {self.fuse}, "
                            f"host {self.host}.")
        if self.stash is not None and (self.decision != Decision.TILE
                                       or self.stash not in ("device", "host")):
            raise PlanError(f"Region {self.label}: stash is 'device' or 'host' and applies "
                            f"to tiled regions only; got stash {self.stash!r}, decision "
                            f"{self.decision!r}.")
        if self.stash_norms is not None and (
                self.stash is None or any(not isinstance(j, int) or j < 0
                                          for j in self.stash_norms)):
            raise PlanError(f"Region {self.label}: stash_norms lists normalisations by their "
                            f"order in the run (non-negative ints) and needs a stash; got "
                            f"stash_norms {self.stash_norms!r}, stash {self.stash!r}.")
        if self.decision == Decision.TILE and (self.policy is not None or self.storage_dtype):
            raise PlanError(f"Region {self.label}: a tiled region takes no op policy or "
                            "storage dtype (it keeps only its inputs).")
        if self.calls is not None and any((not isinstance(c, int)) or c < 0 for c in self.calls):
            raise PlanError(f"Region {self.label}: calls must be non-negative integers.")


@dataclass
class Plan:
    """Regions plus what the plan was made for and what it predicts."""

    regions: list[Region] = field(default_factory=list)
    model: str = ""
    model_fingerprint: str | None = None
    input_shapes: list[list[int]] = field(default_factory=list)
    amp: str | None = None
    budget_bytes: int | None = None
    strategy: str = "manual"
    offload_min_bytes: int = 1 << 20  # smaller saved tensors stay on the device
    # the most host memory the plan may use (None: no limit): offloaded saved tensors past
    # it stay on the device; the planner passes over tiled layouts that hold more there
    host_budget_bytes: int | None = None
    # offload: in backward, start copying the previous region's tensors back as soon as a
    # region's are needed (hides the copy; holds both regions' tensors for a while)
    prefetch: bool = True
    # outside regions, save cheap ops' outputs (norms, activations, upsampling, skip sums,
    # concatenations) as recipes that rebuild them in backward (runtime/rebuild.py)
    rebuild_saved: bool = True
    predicted_peak_bytes: int | None = None
    verified_peak_bytes: int | None = None
    # host memory the verified step held in host-resident tiled outputs (Region.host)
    verified_host_bytes: int | None = None
    # the innermost module running when the verified step reached its peak (qualified
    # name; None: outside every module, or not verified)
    verified_peak_module: str | None = None
    # when it reached it: "forward" or "backward" (None: not verified, or unknown)
    verified_peak_phase: str | None = None
    # per tiled region's label, the most device bytes live while its run's passes ran
    # ("forward", backward "sums" and "final"): where the planner finds room for what
    # only that run holds
    verified_tiled_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    recompute_flops: int | None = None
    # FLOPs of the verified planned step minus the unplanned step's: recomputation plus,
    # for tiled regions, their extra passes and halos
    extra_flops: int | None = None
    step_flops: int | None = None  # the unplanned step's FLOPs (forward + backward)
    notes: list[str] = field(default_factory=list)
    # a graph plan (remat3d.plan(..., graph=True)): the nodes of the step's aten graph
    # (capture/joint.py) the backward recomputes; None: a plan of module regions
    graph_recompute: list[str] | None = None
    # of graph_recompute, the nodes recomputed a second time for their late readers
    # (planner/liveness.py NOTE rule 4: a U-Net skip read by the decoder and the encoder)
    graph_twice: list[str] = field(default_factory=list)
    # of graph_recompute, the module whose forward ran each node ("" the model's own
    # forward: a parent's torch.cat), where the trace knew it (capture/joint.py NOTE
    # rule 10): what reports say the plan recomputes where
    graph_modules: dict[str, str] = field(default_factory=dict)
    # the graph plan's step graph (capture/joint.py, graph_digest): a step whose graph
    # differs (another precision, model or torch) is refused, not run with this plan
    graph_digest: str | None = None
    # a graph plan's tiled regions (runtime/tiled_graph.py); None: nothing tiled
    graph_tiling: GraphTiling | None = None
    # how the graph plan's graphs run: "eager" (op by op, eager's kernels: bitwise) or
    # "inductor" (compiled by inductor, runtime/inductor.py; remat3d.plan(compiled=True))
    graph_backend: str = "eager"
    # what the search minimised (planner/optimal.py Costs): "time" (FLOPs, and memory-bound
    # recompute its traffic) or "flops" (FLOPs as FlopCounterMode counts them)
    objective: str = "time"
    # spans of parents' forwards that regions name like modules (runtime/spans.py): parent
    # module name -> for each span, its torch.fx node names; span k is "<parent>.@k"
    spans: dict[str, list[list[str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.regions = [r if isinstance(r, Region) else Region(**r) for r in self.regions]
        if isinstance(self.graph_tiling, dict):
            self.graph_tiling = GraphTiling(**self.graph_tiling)
        if self.graph_tiling is not None and self.graph_recompute is None:
            raise PlanError("graph_tiling is for a graph plan (graph_recompute); module "
                            "plans tile with tile regions.")
        for region in self.regions:
            region.check()
        if self.graph_recompute is not None and self.regions:
            raise PlanError("A plan is either a graph plan (graph_recompute) or a plan of "
                            "module regions, not both.")
        if self.graph_recompute is not None and self.spans:
            raise PlanError("A graph plan (graph_recompute) has no spans: spans are "
                            "regions of a module plan.")
        if self.graph_backend not in GRAPH_BACKENDS:
            raise PlanError(f"graph_backend is {self.graph_backend!r}; a graph plan's "
                            "graphs run 'eager' (op by op) or 'inductor' (compiled).")
        if self.objective not in OBJECTIVES:
            raise PlanError(f"objective is {self.objective!r}; a plan minimises one of "
                            f"{', '.join(OBJECTIVES)}.")
        named = sorted(set(self.graph_modules) - set(self.graph_recompute or ()))
        if named:
            raise PlanError(f"graph_modules names nodes graph_recompute does not "
                            f"({', '.join(named[:5])}): it says where recomputed nodes "
                            "run.")
        stray = sorted(set(self.graph_twice) - set(self.graph_recompute or ()))
        if stray:
            raise PlanError(f"graph_twice names nodes graph_recompute does not "
                            f"({', '.join(stray[:5])}): a node is recomputed twice only if "
                            "it is recomputed.")

    @property
    def tiled(self) -> bool:
        """Whether any region runs tiled (its extra FLOPs are then more than recomputation)."""
        return self.graph_tiling is not None or \
            any(r.decision == Decision.TILE for r in self.regions)

    @property
    def offloads(self) -> bool:
        """Whether any region offloads its saved tensors to host memory."""
        return any(r.decision == Decision.OFFLOAD for r in self.regions)

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = PLAN_SCHEMA
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        schema = data.get("schema")
        if schema != PLAN_SCHEMA:
            raise PlanError(
                f"Unsupported plan schema {schema!r}; this remat3d reads {PLAN_SCHEMA!r}. "
                "Re-create the plan with this version (remat3d plan ...)."
            )
        names = {f.name for f in fields(cls)}
        if "share_concat" in data:  # written before concatenations became recipes
            data = {k: v for k, v in data.items() if k != "share_concat"}
        unknown = sorted(set(data) - names - {"schema"})
        if unknown:
            raise PlanError(f"Unknown plan field(s): {', '.join(unknown)}.")
        region_names = {f.name for f in fields(Region)}
        regions = []
        for r in data.get("regions", []):
            extra = sorted(set(r) - region_names)
            if extra:
                raise PlanError(f"Unknown region field(s): {', '.join(extra)}.")
            regions.append(Region(**r))
        return cls(**{**{k: v for k, v in data.items() if k in names}, "regions": regions})

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise PlanError(f"Plan file {str(path)!r} does not exist.") from None
        except json.JSONDecodeError as exc:
            raise PlanError(f"Plan file {str(path)!r} is not valid JSON: {exc}.") from None
        return cls.from_dict(data)

    # -- text ---------------------------------------------------------------------------
    def recomputed_where(self) -> list[tuple[str, str]]:
        """A graph plan's recomputed ops by the module whose forward runs them (its
        name; the model's own forward, or "outside any module's forward" where the trace
        did not say), in the step's order: (module, the ops as "kind" or "kind ×n",
        ``getitem`` picks left out). Empty for a module plan."""
        where: dict[str, dict[str, int]] = {}
        named = set(self.graph_modules)  # (in the step's order)
        for name in [*self.graph_modules,
                     *(n for n in self.graph_recompute or () if n not in named)]:
            module = self.graph_modules.get(name)
            label = ("outside any module's forward" if module is None else module
                     or f"{self.model or 'the model'}'s own forward")
            kind = re.sub(r"_\d+$", "", name)  # FX names an op's nth node "<op>_<n>"
            if kind != "getitem":
                ops = where.setdefault(label, {})
                ops[kind] = ops.get(kind, 0) + 1
        return [(label, ", ".join(k if n == 1 else f"{k} ×{n}" for k, n in ops.items()))
                for label, ops in where.items()]

    def summary(self) -> str:
        counts = {d: sum(r.decision == d for r in self.regions) for d in DECISIONS}
        parts = ", ".join(f"{n} {d}" for d, n in counts.items() if n)
        lines = [f"remat3d plan: {len(self.regions)} regions ({parts or 'none'})"]
        if self.graph_recompute is not None:
            twice = f" ({len(self.graph_twice)} of them twice)" if self.graph_twice else ""
            lines = [(f"remat3d graph plan: {len(self.graph_recompute)} ops of the step's "
                     f"graph recomputed in backward{twice}"
                     f"{', compiled by inductor' if self.graph_backend == 'inductor' else ''}")]
            if self.graph_tiling is not None:
                t = self.graph_tiling
                grids = "finest grid" if t.levels == 1 else f"{t.levels} finest grids"
                stashes = "" if t.stash == "none" else f", stashing {t.stash}"
                if t.stashes:
                    stashes += ", stashes in " + ", ".join(f"{k} ({v})" for k, v in t.stashes)
                lines.append(f"  tiled: the {grids} in tiles of {format_shape(t.tile)}"
                             f"{', copies across regions' if t.copy else ''}{stashes}")
        if self.model:
            shapes = " ".join(format_shape(s) for s in self.input_shapes)
            objective = "" if self.objective == "time" else f" objective={self.objective}"
            lines.append(f"  made for {self.model} {shapes} amp={self.amp or 'none'} "
                         f"strategy={self.strategy}{objective}")
        if self.budget_bytes is not None:
            lines.append(f"  budget {format_bytes(self.budget_bytes)}")
        for label, value in (("predicted peak", self.predicted_peak_bytes),
                             ("verified peak", self.verified_peak_bytes)):
            if value is not None:
                lines.append(f"  {label} {format_bytes(value)}")
        if self.recompute_flops is not None:
            lines.append(f"  recompute {_flops(self.recompute_flops, self.step_flops)}")
        if self.verified_host_bytes:
            host = format_bytes(self.verified_host_bytes)
            lines.append(f"  host memory for tiled outputs {host}")
        if self.offloads and not self.prefetch:
            lines.append("  offload: copied back on demand (no prefetch)")
        if self.extra_flops is not None and self.tiled:
            lines.append(f"  extra FLOPs (recompute, tile passes, halos) "
                         f"{_flops(self.extra_flops, self.step_flops)}")
        for region in self.regions:
            extra = ""
            if region.policy:
                extra += f" policy={region.policy}"
            if region.storage_dtype:
                extra += f" storage={region.storage_dtype}"
            if region.tile:
                extra += " tile=" + format_shape(region.tile)
            if region.fuse:
                extra += " fused"
            if region.host:
                extra += " output on host"
            if region.rebuild:
                extra += " output rebuilt"
            if region.rebuild_in_tiles:
                extra += " (rebuilt inputs in tiles)"
            if region.hand_inputs:
                extra += " (inputs handed on)"
            if region.stash:
                extra += f" stash on {region.stash}"
            if region.stash_norms is not None:
                extra += " (normalisations " + ", ".join(map(str, region.stash_norms)) + ")"
            lines.append(f"  - {region.decision:9s} {region.label}{extra}")
        for module, ops in self.recomputed_where():
            lines.append(f"  - recompute {module}: {ops}")
        named = {r.module for r in self.regions}
        for parent, spans in self.spans.items():  # the spans regions name (runtime/spans.py)
            for k, nodes in enumerate(spans):
                label = f"{parent}.@{k}" if parent else f"@{k}"
                if label in named:
                    lines.append(f"  span {label}: {', '.join(nodes)} of "
                                 f"{parent or 'the model'}'s forward")
        return "\n".join(lines)


def _flops(value: int, step: int | None) -> str:
    text = f"{value / 1e12:.3f} TFLOP" if value >= 1e11 else f"{value / 1e9:.3f} GFLOP"
    if step:
        text += f" ({100 * value / step:+.1f} % of the unplanned step)"
    return text
