"""Applied module plans under torch.compile (runtime/compiled.py, NOTE [ Plans under
torch.compile ]): recompute regions compile without a graph break; tiled and offload
regions run eagerly behind one break each; gradients equal the eager planned step's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d import Plan, Region
from remat3d.errors import InfeasibleBudgetError, PlanError
from tests.runtime.exactness import train_step


def _net() -> nn.Module:
    torch.manual_seed(0)

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1),
                             nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(inplace=True))

    return nn.Sequential(block(1, 4), block(4, 8), block(8, 4), nn.Conv3d(4, 2, 1))


X = (1, 1, 16, 16, 16)


def _compiled_step(model: nn.Module, x: torch.Tensor):  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    for p in model.parameters():
        p.grad = None
    out = compiled(x)
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def _breaks(model: nn.Module, x: torch.Tensor) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(x).graph_break_count


def _assert_compiles_bitwise(model: nn.Module, x: torch.Tensor, reference: nn.Module,
                             *, prefix: str = "", no_break: bool = True) -> None:
    """The compiled step of ``model`` (``aot_eager``: eager's aten kernels) equals
    ``reference``'s eager step bit for bit (``prefix``: where ``reference``'s parameters
    sit in ``model``), with no graph break unless ``no_break`` is False."""
    eager_out, eager_grads, _ = train_step(reference, x)
    if no_break:
        assert _breaks(model, x) == 0
    out, grads = _compiled_step(model, x)
    assert torch.equal(out, eager_out[0])
    assert all(torch.equal(grads[prefix + n], g) for n, g in eager_grads.items())


@pytest.mark.parametrize("policy", [None, "save-compute-heavy", ["convolution"]])
def test_recompute_regions_compile_without_a_graph_break_and_keep_the_gradients(
        policy) -> None:  # type: ignore[no-untyped-def]
    net = _net()
    x = torch.randn(X)
    plan = Plan(regions=[Region("0", policy=policy), Region("1"), Region("2")])
    planned = remat3d.apply(copy.deepcopy(net), plan)
    # the recomputed step is bit-identical to the unplanned one
    _assert_compiles_bitwise(planned, x, copy.deepcopy(net))


def test_tiled_and_offload_regions_run_eagerly_in_a_compiled_step() -> None:
    from remat3d.runtime.apply import applied_state

    net = _net()
    x = torch.randn(X)
    plan = Plan(regions=[Region("0", decision="tile", tile=[8, 8, 8]),
                         Region("1", decision="offload"), Region("2")])
    planned = remat3d.apply(copy.deepcopy(net), plan)
    # against the plan's own eager step (tiled: not bitwise the unplanned one)
    _assert_compiles_bitwise(planned, x, planned, no_break=False)
    # every region ran in the compiled step's forward (the tiled and the offload one as
    # planned, eagerly, outside the graph)
    stats = applied_state(planned).stats  # type: ignore[union-attr]
    assert all(stats[label].forward_runs == 1 for label in ("0", "1", "2"))


def test_a_fused_tiled_output_is_materialised_for_the_compiled_graph() -> None:
    net = _net()
    x = torch.randn(X)
    plan = Plan(regions=[Region("0", decision="tile", tile=[8, 8, 8], fuse=True),
                         Region("1", decision="tile", tile=[8, 8, 8])])
    planned = remat3d.apply(copy.deepcopy(net), plan)
    eager_out, eager_grads, _ = train_step(planned, x)
    with pytest.warns(RuntimeWarning, match="stored on the device"):
        out, grads = _compiled_step(planned, x)
    # the fused output is computed once instead of inside the reader's tiles: the same
    # values up to the order of the normalisation's sums
    torch.testing.assert_close(out, eager_out[0], rtol=1e-5, atol=1e-6)
    for n, g in eager_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6)


def test_a_graph_plan_compiles_and_keeps_the_gradients() -> None:
    net = _net()
    x = torch.randn(X)
    plan = remat3d.plan(net, X, budget="0.7x", graph=True)
    assert plan.graph_recompute
    planned = remat3d.apply(copy.deepcopy(net), plan)
    _assert_compiles_bitwise(planned, x, planned)


def test_remat3d_checkpoint_inside_a_compiled_model_compiles_without_a_graph_break() -> None:
    net = _net()
    x = torch.randn(X)

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = remat3d.checkpoint(self.inner[0], x, policy="save-compute-heavy")
            h = remat3d.checkpoint(self.inner[1], h)
            return self.inner[3](self.inner[2](h))

    _assert_compiles_bitwise(Wrapped(copy.deepcopy(net)), x, copy.deepcopy(net),
                             prefix="inner.")


@pytest.mark.slow  # -m slow: 40 s (plans and compiles nnunet at 64³)
def test_the_compile_check_reports_peaks_and_gradients(capsys) -> None:  # type: ignore[no-untyped-def]
    from remat3d.bench.compile_check import main

    main(["--preset", "nnunet", "--size", "64", "--budget", "0.75x",
          "--backend", "aot_eager"])
    out = capsys.readouterr().out
    assert "compiled, planned" in out and "verified (meta) peak" in out
    # aot_eager runs eager's kernels: the compiled planned step is the eager planned one
    assert "vs eager planned: 0;" in out


@pytest.mark.slow  # -m slow: 30 s (nnU-Net v2's PlainConvUNet at 64³)
def test_nnunet_v2_with_spans_compiles_without_a_graph_break() -> None:
    pytest.importorskip("dynamic_network_architectures")
    from remat3d import zoo

    torch.manual_seed(0)
    net = zoo.build_model("nnunetv2")
    x = torch.randn(1, 1, 64, 64, 64)
    plan = remat3d.plan(net, tuple(x.shape), budget="0.3x", graph=False, strategy="blocks")
    assert plan.spans  # the decoder's transposed conv + cat + stage as one unit
    planned = remat3d.apply(copy.deepcopy(net), plan)
    _assert_compiles_bitwise(planned, x, planned)


def test_a_plan_for_compilation_is_verified_as_it_runs_compiled() -> None:
    """``remat3d.plan(..., compiled=True, graph=False)``: a module plan, searched and
    verified without rebuilt saved tensors (a compiled step has none: NOTE rule 4); it
    compiles with no graph break and warns of nothing. A plan verified with rebuilt
    tensors warns once, while dynamo traces (no graph break), that its promise does not
    hold compiled. (Without ``graph=False``: a graph plan compiled by inductor,
    ``tests/runtime/test_inductor.py``.)"""
    import warnings

    from remat3d import zoo

    torch.manual_seed(0)
    net, shape = zoo.build_model("basicunet"), (1, 1, 32, 32, 32)
    x = torch.randn(shape)
    plan = remat3d.plan(net, shape, budget="0.9x", compiled=True, tile=False, graph=False)
    assert not plan.rebuild_saved and plan.graph_recompute is None and plan.regions
    assert plan.verified_peak_bytes is not None and plan.verified_peak_bytes <= plan.budget_bytes
    assert plan == remat3d.plan(net, shape, budget="0.9x", compiled=True, tile=False,
                                graph=False)  # cached
    assert remat3d.plan(net, shape, budget="0.9x", tile=False).graph_recompute  # a graph
    with pytest.raises(PlanError, match="does not offload"):
        remat3d.plan(net, shape, budget="0.9x", compiled=True, offload=True, graph=False)
    # tiling is off: below what recompute regions reach, the error says so, not a tile
    with pytest.raises(InfeasibleBudgetError):
        remat3d.plan(net, shape, budget="0.5x", compiled=True, graph=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compiled=True")  # nothing to warn of
        planned = remat3d.apply(copy.deepcopy(net), plan)
        # MONAI's BasicUNet breaks dynamo's graph itself; the plan adds no break
        assert _breaks(planned, x) <= _breaks(copy.deepcopy(net), x)
        _assert_compiles_bitwise(planned, x, copy.deepcopy(net), no_break=False)
    net, x = _net(), torch.randn(X)
    rebuilt = Plan(regions=[Region("1")], verified_peak_bytes=1, rebuild_saved=True)
    planned = remat3d.apply(copy.deepcopy(net), rebuilt)
    with pytest.warns(RuntimeWarning, match="compiled=True") as caught:
        _assert_compiles_bitwise(planned, x, copy.deepcopy(net))
    assert sum("compiled=True" in str(w.message) for w in caught) == 1  # once per plan
