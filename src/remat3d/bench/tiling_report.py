"""Regenerate the numbers in ``docs/tiling.md``: exactness per preset, and nnU-Net at 512³.

``remat3d bench tiling [--exactness] [--size 512] [--tile 128]``
``remat3d bench tiling --layouts [--host] [--size 512]``
``remat3d bench tiling --stored-skip [--size 512]``
``remat3d bench tiling --budgets 24,26,28 [--model nnunetv2] [--host] [--size 512]``

- exactness: each of nnunet, unet, basicunet, segresnet, one fp32 CPU training step with
  the full-resolution stages tiled (``presets.full_resolution_plan``) against the same
  step untiled: the largest relative error of the output, of every gradient and of the
  buffers, for tiles that divide the volume and tiles that do not;
- memory: one nnU-Net training step on the meta device with bf16 autocast, measured by
  the tracker (``remat3d.measure``): untiled; full-resolution modules tiled; and
  ``nnunet_whole_volume_forward``, which tiles the two outer levels of the U-Net as two
  runs that never hold a full-resolution activation (see docs/tiling.md);
- stored skip: nnU-Net v2's PlainConvUNet at 512³ bf16 without host memory, its
  full-resolution skip stored on the device (read by two tiled runs that share its
  gradient, NOTE [ Shared input gradients ]) against recomputed in both readers, and
  the two outer skips rebuilt in each reader's backward (NOTE [ Rebuilt tiled outputs ]):
  how a 24 GiB plan without offload gets by (docs/tiling.md);
- budgets: ``remat3d.plan`` (``optimal``, bf16 autocast, meta) at each budget: the
  verified peak and the FLOPs should not rise as the budget does.
"""

from __future__ import annotations

import argparse
import copy
import time
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat3d.units import format_bytes

__all__ = ["budget_rows", "exactness_rows", "memory_rows", "nnunet_whole_volume_forward",
           "stored_skip_rows"]

GiB = 2**30


def nnunet_whole_volume_forward(model: nn.Module, tile: int, skip: str = "output",
                                checkpoint_inner: bool = True) -> None:
    """Make a DynUNet (``nnunet`` preset) run its two outer levels tiled (by hand).

    ``tile`` is the full-resolution tile edge; runs whose output is at half resolution
    use ``tile // 2`` (tile sizes are in output coordinates). The decoder's top stage and
    the 1x1 head are one tiled run, so the top stage's 32-channel output is never stored.

    - ``skip="output"``: ``x -> (skip, downsamples[0](skip))`` with ``skip =
      input_block(x)`` is one tiled run with two outputs; the skip (32 channels at full
      resolution) is kept for the decoder, and no full-resolution input gradient is ever
      allocated (``x`` needs none).
    - ``skip="recompute"``: ``x -> downsamples[0](input_block(x))`` is one tiled run, so
      the skip is never stored; the decoder's top run recomputes it from ``x``:
      ``(u, x) -> output_block(upsamples[-1](u, input_block(x)))``. Least memory; 4
      normalisations in that run, so more passes.
    - ``skip="separate"``: ``input_block`` and ``downsamples[0]`` are two tiled runs and
      the skip is kept; the second run's full-resolution input gradient is added to the
      decoder's by autograd (two 32-channel full-resolution gradients at once).

    ``upsamples[-2]`` (half resolution) is tiled too, and the levels below are one
    recompute region when ``checkpoint_inner``. Installed as an instance ``forward``;
    ``del model.forward`` undoes it.
    """
    from remat3d.runtime.region import checkpoint
    from remat3d.runtime.tiling import tile as run_tiled

    top: Any = model.skip_layers      # DynUNetSkipLayer: downsample, next_layer, upsample
    second: Any = top.next_layer
    head: Any = model.output_block
    half = max(tile // 2, 1)

    if skip not in ("output", "recompute", "separate"):
        raise ValueError(f"skip must be 'output', 'recompute' or 'separate', got {skip!r}")

    def encoder(x: torch.Tensor) -> torch.Tensor:
        return second.downsample(top.downsample(x))

    def encoder_with_skip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s0 = top.downsample(x)
        return s0, second.downsample(s0)

    def decoder_from_input(u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return head(top.upsample(u, top.downsample(x)))

    def decoder(u: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return head(top.upsample(u, skip))

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if skip == "output":
            s0, s1 = run_tiled(encoder_with_skip, x, tile=tile)
        elif skip == "separate":
            s0 = run_tiled(top.downsample, x, tile=tile)
            s1 = run_tiled(second.downsample, s0, tile=half)
        else:
            s1 = run_tiled(encoder, x, tile=half)
        inner = checkpoint(second.next_layer, s1) if checkpoint_inner else second.next_layer(s1)
        u = run_tiled(second.upsample, inner, s1, tile=half)
        if skip == "recompute":
            return run_tiled(decoder_from_input, u, x, tile=tile)
        return run_tiled(decoder, u, s0, tile=tile)

    object.__setattr__(model, "forward", types.MethodType(forward, model))


SETUPS = ("untiled", "full-resolution modules tiled", "outer two levels tiled, skip separate",
          "outer two levels tiled, skip output", "outer two levels tiled, skip recompute")


def memory_rows(size: int, tile: int, setups: Sequence[str] = SETUPS) -> list[dict[str, Any]]:
    import remat3d
    from remat3d import zoo
    from remat3d.zoo.full_resolution import full_resolution_plan

    x = torch.empty(1, 1, size, size, size, device="meta")
    rows = []
    for label in setups:
        model = zoo.build_model("nnunet", device="meta")
        if label.startswith("full"):
            remat3d.apply(model, full_resolution_plan("nnunet", tile))
        elif label.startswith("outer"):
            nnunet_whole_volume_forward(model, tile, skip=label.rsplit(" ", 1)[1])
        start = time.perf_counter()
        m = remat3d.measure(model, x, device="meta", amp="bf16")
        rows.append({"setup": label, "peak_bytes": m.peak_bytes, "flops": m.flops,
                     "saved_bytes": m.saved_bytes, "breakdown": m.breakdown,
                     "seconds": time.perf_counter() - start})
    return rows


def layout_rows(size: int, amp: str | None = "bf16", host: bool = False
                ) -> list[dict[str, Any]]:
    """Every tiling layout ``remat3d.plan`` tries for nnU-Net at ``size``³, in its order
    (NOTE [ Tiling layouts ]; ``host``: as with offload allowed), each measured on meta
    like the planner verifies it."""
    import remat3d
    from remat3d import zoo
    from remat3d.planner.stages import build_stages
    from remat3d.planner.tiled_plans import layout_regions
    from remat3d.planner.tiling import layouts
    from remat3d.planspec import Plan
    from remat3d.runtime.tiling.probe import tileable

    model = zoo.build_model("nnunet", device="meta")
    shapes = [(1, 1, size, size, size)]
    prof = remat3d.profile(model, *shapes, device="meta", amp=amp)
    stages = build_stages(prof.graph)
    ok = tileable(model, shapes, amp, [(st.name, st.call_index) for st in stages.stages])
    rows = [{"setup": "untiled", "peak_bytes": prof.peak_bytes,
             "flops": prof.graph.forward_flops + prof.graph.backward_flops}]
    for layout in layouts(prof.graph, stages, ok, host=host):
        planned = zoo.build_model("nnunet", device="meta")
        remat3d.apply(planned, Plan(regions=layout_regions(stages, layout)))
        m = remat3d.measure(planned, *shapes, device="meta", amp=amp)
        rows.append({"setup": layout.label, "peak_bytes": m.peak_bytes, "flops": m.flops,
                     "host_bytes": m.host_bytes,
                     "tiled": ", ".join(
                         stages.stages[s].name + ("" if out == "device" else f" ({out})")
                         for s, (_t, out) in sorted(layout.tiled.items()))})
    return rows


def _skip_regions(size: int, skip: str, top: int, tile_level2: bool) -> list[Any]:
    """nnU-Net v2's outer levels tiled (full-resolution tile ``size // 4``, the top decoder
    run's ``top``), the skip stored, fused, or rebuilt with the level-1 skip (``"rebuilt"``;
    ``"handed"``: the level-1 stage also hands the skip it rebuilt to its own backward,
    the encoder's level-1 reader tiled too), every other stage recomputed."""
    from remat3d.planspec import Region

    t = size // 4
    rebuilt = skip in ("rebuilt", "handed")
    tiled = {
        "encoder.stages.0": Region("encoder.stages.0", decision="tile", tile=[t] * 3,
                                   fuse=skip == "fused", rebuild=rebuilt),
        "encoder.stages.1": Region("encoder.stages.1", decision="tile", tile=[t // 2] * 3,
                                   rebuild=rebuilt, hand_inputs=skip == "handed"),
        "decoder.@3": Region("decoder.@3", decision="tile", tile=[t // 2] * 3,
                             stash="device"),
        "decoder.@4": Region("decoder.@4", decision="tile", tile=[top] * 3, fuse=True),
        "decoder.seg_layers.4": Region("decoder.seg_layers.4", decision="tile",
                                       tile=[top] * 3),
    }
    if tile_level2:
        tiled["decoder.@2"] = Region("decoder.@2", decision="tile", tile=[t // 4] * 3,
                                     stash="device")
    if rebuilt:  # the level-1 skip's encoder reader, tiled (else it would keep it)
        tiled["encoder.stages.2"] = Region("encoder.stages.2", decision="tile",
                                           tile=[t // 4] * 3)
    recomputed = [Region(name) for name in ("encoder.stages.2", "encoder.stages.3",
                                            "encoder.stages.4", "encoder.stages.5",
                                            "decoder.@0", "decoder.@1", "decoder.@2")
                  if name not in tiled]
    return [*tiled.values(), *recomputed]


STORED_SKIP_SETUPS = [  # (label, skip, top decoder run's tile edge / size, level 2 tiled)
    ("skip fused into both readers", "fused", 4, False),
    ("skip stored", "stored", 4, False),
    ("skip stored, top decoder run in 8ths", "stored", 8, False),
    ("skip stored, top run in 8ths, decoder.@2 tiled", "stored", 8, True),
    ("skips rebuilt, top run in 8ths, decoder.@2 tiled", "rebuilt", 8, True),
    ("skips rebuilt and handed, top run in 8ths, decoder.@2 tiled", "handed", 8, True),
]


def stored_skip_rows(size: int = 512) -> list[dict[str, Any]]:
    """nnU-Net v2 (``nnunetv2``) at ``size``³ bf16 on meta, no host memory: the
    full-resolution skip recomputed in both of its readers' runs, or stored (its two tiled
    readers sharing one gradient), each measured like the planner verifies."""
    import remat3d
    from remat3d import zoo
    from remat3d.planspec import Plan
    from remat3d.runtime.spans import spans_for

    model = zoo.build_model("nnunetv2", device="meta")
    shape = (1, 1, size, size, size)
    prof = remat3d.profile(model, shape, device="meta", amp="bf16")
    spans = spans_for(model, prof.graph)
    base = prof.graph.forward_flops + prof.graph.backward_flops
    rows = [{"setup": "untiled", "peak_bytes": prof.peak_bytes, "flops": base, "at": ""}]
    for label, skip, part, level2 in STORED_SKIP_SETUPS:
        planned = zoo.build_model("nnunetv2", device="meta")
        regions = _skip_regions(size, skip, size // part, level2)
        remat3d.apply(planned, Plan(regions=regions, spans=spans))
        m = remat3d.measure(planned, shape, device="meta", amp="bf16")
        rows.append({"setup": label, "peak_bytes": m.peak_bytes, "flops": m.flops,
                     "at": m.peak_modules[0] if m.peak_modules else "",
                     "live": m.peak_tensors})
    return rows


def budget_rows(model_name: str, budgets: Sequence[str], size: int = 512,
                offload: bool = False) -> list[dict[str, Any]]:
    """``remat3d.plan(model, 1x1x size³, budget, amp="bf16", offload=...)`` at each
    budget: the verified peak and host memory, the FLOPs against the unplanned step's,
    the tiled regions and the planning time; at a budget no plan fits, the smallest
    feasible budget the error names (``smallest_bytes``) and the time it took to find."""
    import remat3d
    from remat3d import zoo
    from remat3d.errors import InfeasibleBudgetError

    rows: list[dict[str, Any]] = []
    for budget in budgets:
        start = time.perf_counter()
        try:
            plan = remat3d.plan(zoo.build_model(model_name, device="meta"),
                                (1, 1, size, size, size), budget=budget, amp="bf16",
                                offload=offload)
        except InfeasibleBudgetError as exc:
            rows.append({"budget": budget, "smallest_bytes": exc.smallest_feasible_bytes,
                         "seconds": time.perf_counter() - start})
            continue
        rows.append({"budget": budget, "peak_bytes": plan.verified_peak_bytes or 0,
                     "host_bytes": plan.verified_host_bytes or 0,
                     "flops": 1 + (plan.extra_flops or 0) / (plan.step_flops or 1),
                     "tiled": ", ".join(
                         f"{r.module} {'x'.join(map(str, r.tile or []))}"
                         + (" fused" if r.fuse else " host" if r.host else
                            " rebuilt" if r.rebuild else "")
                         + (" inputs in tiles" if r.rebuild_in_tiles else "")
                         + (f" stash {r.stash}" if r.stash else "")
                         + (f" (norms {','.join(map(str, r.stash_norms))})"
                            if r.stash_norms is not None else "")
                         for r in plan.regions if r.decision == "tile"),
                     "seconds": time.perf_counter() - start})
    return rows


EXACTNESS_CASES: list[tuple[str, int, Any]] = [
    ("nnunet", 64, 64), ("nnunet", 64, 24), ("nnunet", 64, (40, 64, 27)),
    ("unet", 32, 12), ("unet", 48, (20, 48, 17)),
    ("basicunet", 32, 20), ("basicunet", 48, (13, 48, 22)),
    ("segresnet", 32, 12), ("segresnet", 48, (19, 48, 30)),
]


def exactness_rows() -> list[dict[str, Any]]:
    """Per case: tiled vs untiled in fp32 and in fp64, and the fp32 noise floor."""
    rows = []
    floors: dict[tuple[str, int], dict[str, float]] = {}
    for preset, size, tile in EXACTNESS_CASES:
        if (preset, size) not in floors:
            floors[preset, size] = split_errors(step_errors(preset, size, tile,
                                                            reference="float64"))
        rows.append({"preset": preset, "size": size, "tile": tile,
                     "fp32": split_errors(step_errors(preset, size, tile)),
                     "fp64": split_errors(step_errors(preset, size, tile, torch.float64)),
                     "fp32_floor": floors[preset, size]})
    return rows


def step_errors(preset: str, size: int, tile: Any, dtype: torch.dtype = torch.float32,
                reference: str = "untiled", device: str = "cpu") -> dict[str, float]:
    """Largest relative error per tensor of a tiled step on ``device`` against the untiled one.

    ``reference="float64"`` compares the *untiled* step in ``dtype`` with the untiled step
    in float64 instead: the network's own rounding noise in ``dtype``, the floor below
    which no reordering of its sums (tiling among them) can be compared.
    """
    import remat3d
    from remat3d import zoo
    from remat3d.zoo.full_resolution import full_resolution_plan

    torch.manual_seed(0)
    model = zoo.build_model(preset).to(device)
    model.train()
    x = torch.randn(1, 1, size, size, size, device=device)
    other = copy.deepcopy(model)
    if reference == "float64":
        model, x = model.double(), x.double()
        other = other.to(dtype)
    else:
        model, x = model.to(dtype), x.to(dtype)
        other = other.to(dtype)
        remat3d.apply(other, full_resolution_plan(preset, tile))
    results = []
    for net in (model, other):
        x = x.to(next(net.parameters()).dtype)
        xi = x.clone().requires_grad_(True)
        out = net(xi)
        seed = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
        seed = seed.reshape(out.shape)
        (out * seed).sum().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        assert xi.grad is not None
        grads["input"] = xi.grad
        buffers = {n: b.clone() for n, b in net.named_buffers()}
        results.append((out.detach(), grads, buffers))
    (ref_out, ref_g, ref_b), (out, g, b) = results
    scale = max(t.abs().max().item() for t in ref_g.values())
    errors = {"output": _rel(out, ref_out, 0.0)}
    for name, ref in ref_g.items():
        # zero in exact arithmetic (a bias right before a normalisation): rounding noise on
        # both sides, compared on the scale of the largest gradient
        noise = ref.abs().max().item() < 1e-4 * scale
        errors[name] = _rel(g[name], ref, scale if noise else 0.0)
    for name, ref in ref_b.items():
        errors[name] = _rel(b[name].double(), ref.double(), 1e-12)
    return errors


def split_errors(errors: dict[str, float]) -> dict[str, float]:
    """Output, worst gradient and worst buffer of a ``step_errors`` result."""
    buffers = [v for k, v in errors.items() if "running" in k or "num_batches" in k]
    grads = [v for k, v in errors.items() if k != "output" and "running" not in k
             and "num_batches" not in k]
    return {"output": errors["output"], "grads": max(grads),
            "buffers": max(buffers) if buffers else float("nan")}


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), floor, 1e-30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench tiling",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--exactness", action="store_true")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--tile", type=int, default=128)
    parser.add_argument("--layouts", action="store_true",
                        help="the planner's tiling layouts at --size, instead of --setups")
    parser.add_argument("--host", action="store_true",
                        help="with --layouts: also the layouts that keep tiled outputs in "
                             "host memory (the planner's with offload allowed)")
    parser.add_argument("--stored-skip", action="store_true",
                        help="nnunetv2 without host memory: the full-resolution skip "
                             "stored (its readers sharing a gradient) or recomputed")
    parser.add_argument("--budgets", default=None,
                        help="comma-separated budgets (24,26,28): the plans of --model at "
                             "each, with --host allowing host memory")
    parser.add_argument("--model", default="nnunetv2", help="with --budgets: a zoo preset")
    parser.add_argument("--setups", default=";".join(SETUPS),
                        help="separated by ;, the first is the FLOP reference")
    args = parser.parse_args(argv)
    if args.exactness:
        print("| preset | volume | tile | fp32: output / worst grad / buffers | "
              "fp32 noise floor (untiled fp32 vs fp64): output / worst grad | "
              "fp64: output / worst grad / buffers |")
        print("|---|---|---|---|---|---|")
        for r in exactness_rows():
            f32, f64, floor = r["fp32"], r["fp64"], r["fp32_floor"]
            print(f"| {r['preset']} | {r['size']}³ | {r['tile']} | "
                  f"{f32['output']:.1e} / {f32['grads']:.1e} / {f32['buffers']:.1e} | "
                  f"{floor['output']:.1e} / {floor['grads']:.1e} | "
                  f"{f64['output']:.1e} / {f64['grads']:.1e} / {f64['buffers']:.1e} |",
                  flush=True)
    if args.budgets:
        budgets = [b if b.strip()[-1:].isalpha() else f"{b.strip()}GiB"
                   for b in args.budgets.split(",")]
        rows = budget_rows(args.model, budgets, args.size, offload=args.host)
        print(f"\n{args.model} {args.size}³, bf16 autocast, meta, remat3d.plan optimal"
              f"{', host memory allowed' if args.host else ', no host memory'}")
        print("| budget | verified peak | host memory | FLOPs vs unplanned | tiled | "
              "planning |")
        print("|---|---:|---:|---:|---|---:|")
        for r in rows:
            if "smallest_bytes" in r:
                print(f"| {r['budget']} | infeasible: the smallest feasible budget is "
                      f"{format_bytes(r['smallest_bytes'])} | | | | {r['seconds']:.0f} s |",
                      flush=True)
                continue
            print(f"| {r['budget']} | {r['peak_bytes'] / GiB:.2f} GiB | "
                  f"{r['host_bytes'] / GiB:.2f} GiB | {r['flops']:.2f}x | {r['tiled']} | "
                  f"{r['seconds']:.0f} s |", flush=True)
        return
    if args.stored_skip:
        rows = stored_skip_rows(args.size)
        print(f"\nnnunetv2 {args.size}³, bf16 autocast, meta, no host memory")
        print("| setup | step peak | at | FLOPs vs untiled |")
        print("|---|---:|---|---:|")
        for r in rows:
            print(f"| {r['setup']} | {r['peak_bytes'] / GiB:.2f} GiB | {r['at']} | "
                  f"{r['flops'] / rows[0]['flops']:.2f}x |", flush=True)
        print("\nlive at each peak, 256 MiB and more (GiB, category, made by, in):")
        for r in rows[1:]:
            print(f"- {r['setup']}: " + "; ".join(
                f"{t.nbytes / GiB:.2f} {t.category} ({t.made_by}, {t.phase})"
                for t in r["live"] if t.nbytes >= GiB // 4))
        return
    if args.layouts:
        rows = layout_rows(args.size, host=args.host)
        print(f"\nnnunet {args.size}³, bf16 autocast, meta: the planner's tiling layouts")
        print("| layout | tiled stages | step peak | host memory | FLOPs vs untiled |")
        print("|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['setup']} | {r.get('tiled', '')} | {r['peak_bytes'] / GiB:.2f} GiB | "
                  f"{r.get('host_bytes', 0) / GiB:.2f} GiB | "
                  f"{r['flops'] / rows[0]['flops']:.2f}x |", flush=True)
        return
    rows = memory_rows(args.size, args.tile, args.setups.split(";"))
    base = rows[0]
    print(f"\nnnunet {args.size}³, bf16 autocast, meta, tile {args.tile}³")
    print("| setup | step peak | saved at end of forward | FLOPs | vs untiled |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['peak_bytes'] / GiB:.2f} GiB | "
              f"{r['saved_bytes'] / GiB:.2f} GiB | {r['flops'] / 1e12:.1f} T | "
              f"{r['flops'] / base['flops']:.2f}x |", flush=True)
    for r in rows:
        print(r["setup"], {k: f"{v / GiB:.2f}" for k, v in r["breakdown"].items()},
              f"{r['seconds']:.0f}s")


if __name__ == "__main__":
    main()
