"""Acceptance measurements for reversible blocks (issue #5), printed as markdown.

Run ``remat3d bench reversible [--out FILE.md]`` to regenerate the numbers in
``docs/reversible.md``:

1. gradients of a depth-16 :class:`~remat3d.nn.ReversibleSequence` at 32³ against the same
   F and G run as an ordinary network (fp32, CPU), and the input reconstruction error;
2. saved bytes at the end of forward (the tracker, on meta) at depth 4 and 32, reversible
   against ordinary;
3. the ``revunet`` preset's step peak at 128³ on meta next to ``nnunet``'s, with parameter
   counts (and a ``RevUNet`` at nnU-Net's widths, at a similar parameter count);
4. the loss of a small ``RevUNet`` before and after a few steps on a synthetic task.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import remat3d
from remat3d import zoo
from remat3d.graph import atomic_write_text
from remat3d.nn.coupling import AdditiveCoupling
from remat3d.nn.revunet import RevUNet
from remat3d.nn.sequence import ReversibleSequence
from remat3d.units import format_bytes, format_shape

__all__ = ["main"]

# RevUNet at nnU-Net 3d_fullres widths, blocks chosen to come near its parameter count
NNUNET_LIKE = {"channels": (32, 64, 128, 256, 320, 320), "blocks": (3, 3, 3, 3, 4, 3)}


def _half(channels: int) -> nn.Module:
    return nn.Sequential(nn.Conv3d(channels, channels, 3, padding=1),
                         nn.GroupNorm(1, channels), nn.LeakyReLU(0.01, inplace=True))


def _sequence(depth: int, channels: int, reversible: bool = True) -> ReversibleSequence:
    return ReversibleSequence(
        *[AdditiveCoupling(_half(channels // 2), _half(channels // 2)) for _ in range(depth)],
        reversible=reversible)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / a.double().abs().max())


@dataclass
class GradientCheck:
    shape: tuple[int, ...]
    depth: int
    gradient_error: float  # max |Δ| / max |g| over input + parameter gradients together
    worst_tensor_error: float  # the same per tensor, worst tensor (norm-cancelled excluded)
    reconstruction_abs: float
    reconstruction_rel: float
    seconds_ordinary: float
    seconds_reversible: float


def gradient_check(depth: int = 16, size: int = 32, channels: int = 8) -> GradientCheck:
    torch.manual_seed(0)
    seq = _sequence(depth, channels)
    ordinary = ReversibleSequence(*seq.blocks, reversible=False)
    x = torch.randn(1, channels, size, size, size)

    def run(model: nn.Module) -> tuple[list[torch.Tensor], float]:
        xx = x.clone().requires_grad_(True)
        start = time.perf_counter()
        y = model(xx)
        (y * torch.sin(y)).sum().backward()
        seconds = time.perf_counter() - start
        assert xx.grad is not None
        grads = [xx.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return grads, seconds

    run(seq)  # warm-up (first-call allocations), not compared
    runs_ref = [run(ordinary) for _ in range(3)]
    runs_rev = [run(seq) for _ in range(3)]
    ref, rev = runs_ref[0][0], runs_rev[0][0]
    t_ref = sorted(t for _, t in runs_ref)[1]  # median of 3
    t_rev = sorted(t for _, t in runs_rev)[1]
    whole = _relative(torch.cat([g.flatten() for g in ref]), torch.cat([g.flatten() for g in rev]))
    scale = max(float(g.abs().max()) for g in ref)
    # per tensor, skipping tensors whose gradient is ~0 in exact arithmetic (a conv bias
    # right before GroupNorm): noise over noise is not a relative error
    per_tensor = max(_relative(a, b) for a, b in zip(ref, rev)
                     if float(a.abs().max()) > 1e-3 * scale)
    with torch.no_grad():
        rebuilt = seq.inverse(seq(x))
    return GradientCheck(tuple(x.shape), depth, whole, per_tensor,
                         float((rebuilt - x).abs().max()), _relative(x, rebuilt), t_ref, t_rev)


@dataclass
class DepthRow:
    depth: int
    saved_reversible: int
    saved_ordinary: int
    peak_reversible: int
    peak_ordinary: int
    recompute_flops: int


def depth_rows(depths: tuple[int, ...] = (4, 32), size: int = 32,
               channels: int = 8) -> list[DepthRow]:
    def net(depth: int, reversible: bool) -> nn.Module:
        return nn.Sequential(nn.Conv3d(1, channels, 3, padding=1),
                             _sequence(depth, channels, reversible),
                             nn.Conv3d(channels, 2, 1))

    rows = []
    for depth in depths:
        rev = remat3d.measure(net(depth, True), (1, 1, size, size, size), device="meta")
        ordinary = remat3d.measure(net(depth, False), (1, 1, size, size, size), device="meta")
        rows.append(DepthRow(depth, rev.saved_bytes, ordinary.saved_bytes, rev.peak_bytes,
                             ordinary.peak_bytes, rev.recompute_flops))
    return rows


@dataclass
class ModelRow:
    name: str
    params: int
    peak: int
    saved: int
    flops: int
    recompute_flops: int


def model_rows(size: int = 128) -> list[ModelRow]:
    builders: list[tuple[str, Callable[[], nn.Module]]] = [
        ("nnunet (preset)", lambda: zoo.build_model("nnunet", device="meta")),
        ("revunet (preset)", lambda: zoo.build_model("revunet", device="meta")),
        ("revunet at nnU-Net widths", lambda: zoo.build_model("revunet", NNUNET_LIKE,
                                                              device="meta")),
        ("  same, ordinary backward", lambda: zoo.build_model(
            "revunet", {**NNUNET_LIKE, "reversible": False}, device="meta")),
    ]
    rows = []
    for name, build in builders:
        model = build()
        m = remat3d.measure(model, (1, 1, size, size, size), device="meta")
        rows.append(ModelRow(name, sum(p.numel() for p in model.parameters()), m.peak_bytes,
                             m.saved_bytes, m.flops, m.recompute_flops))
    return rows


def synthetic_training(size: int = 32, steps: int = 20) -> tuple[float, float, int]:
    """A bright ball in noise, to segment; returns (first loss, last loss, steps)."""
    torch.manual_seed(0)
    model = RevUNet(channels=(8, 16, 32), blocks=2)
    grid = torch.stack(torch.meshgrid(*[torch.linspace(-1, 1, size)] * 3, indexing="ij"))
    centres = torch.rand(4, 3, 1, 1, 1) - 0.5
    target = torch.stack([((grid - c).square().sum(0) < 0.2).long() for c in centres])
    x = (target.float() + 0.5 * torch.randn(target.shape))[:, None]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1], steps


def report() -> str:
    g = gradient_check()
    lines = [
        "### Gradients against the ordinary network (fp32, CPU)",
        "",
        (f"Depth-{g.depth} `ReversibleSequence` of additive couplings (F, G: conv3d -> "
        f"GroupNorm -> LeakyReLU(inplace) on half the channels), input "
        f"{format_shape(g.shape)}, loss sum(y sin y)."),
        "",
        "| measure | value |",
        "|---|---:|",
        (f"| max relative gradient error, all gradients (max abs diff / max abs grad) | "
        f"{g.gradient_error:.2e} |"),
        f"| worst single tensor (relative to its own max) | {g.worst_tensor_error:.2e} |",
        f"| input reconstruction error, max abs | {g.reconstruction_abs:.2e} |",
        f"| input reconstruction error, relative | {g.reconstruction_rel:.2e} |",
        (f"| CPU step, ordinary / reversible (s, median of 3) | {g.seconds_ordinary:.2f} / "
        f"{g.seconds_reversible:.2f} ({g.seconds_reversible / g.seconds_ordinary:.2f}x) |"),
        "",
        "### Saved bytes at the end of forward against depth (tracker, meta, 1x1x32³, 8 channels)",
        "",
        ("| depth | saved, reversible | saved, ordinary | peak, reversible | peak, ordinary | "
        "recompute FLOPs (reversible) |"),
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = depth_rows()
    lines += [f"| {r.depth} | {format_bytes(r.saved_reversible)} | "
              f"{format_bytes(r.saved_ordinary)} | {format_bytes(r.peak_reversible)} | "
              f"{format_bytes(r.peak_ordinary)} | {r.recompute_flops / 1e9:.2f} G |"
              for r in rows]
    first, last = rows[0], rows[-1]
    lines += ["", (f"Reversible saved bytes, depth {last.depth} vs {first.depth}: "
              f"{last.saved_reversible / first.saved_reversible - 1:+.1%}; ordinary: "
              f"{last.saved_ordinary / first.saved_ordinary:.1f}x."), ""]
    lines += [
        "### One training step at 1x1x128³ (tracker, meta, fp32)",
        "",
        "| model | parameters | step peak | saved for backward | FLOPs | of which recompute |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.name} | {r.params / 1e6:.1f} M | {format_bytes(r.peak)} | "
              f"{format_bytes(r.saved)} | {r.flops / 1e12:.2f} T | "
              f"{r.recompute_flops / 1e12:.2f} T |" for r in model_rows()]
    lines += ["", f"RevUNet at nnU-Net widths: `{NNUNET_LIKE}`.", ""]
    loss0, loss1, steps = synthetic_training()
    lines += [
        "### Learning (CPU, synthetic ball segmentation, 4 x 1x32³, Adam 3e-3)",
        "",
        (f"RevUNet channels (8, 16, 32), 2 couplings per sequence: cross-entropy "
        f"{loss0:.3f} -> {loss1:.3f} after {steps} steps."),
        "",
        (f"Generated {datetime.date.today().isoformat()} on {platform.machine()} "
        f"({os.cpu_count()} cores, {torch.get_num_threads()} threads), torch "
        f"{torch.__version__}, by `remat3d bench reversible`."),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench reversible",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=None, help="write the markdown here")
    args = parser.parse_args(argv)
    text = report()
    if args.out:
        atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
