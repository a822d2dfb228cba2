"""Graph plans compiled by inductor (runtime/inductor.py, NOTE [ Graph plans compiled by
inductor ]): the forward saves what the plan keeps, the gradients are the compiled
unplanned model's within compile's tolerance, torch.compile around the model adds
nothing, and a step inductor cannot compile runs op by op."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import remat3d
from remat3d import Plan
from remat3d.errors import PlanError


class _Net(nn.Module):
    """A small U-Net whose skip is concatenated in its own forward."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1),
                                 nn.InstanceNorm3d(cout, affine=True),
                                 nn.LeakyReLU(0.01, inplace=True))

        self.enc = block(1, 4)
        self.down = nn.Conv3d(4, 8, 2, stride=2)
        self.mid = block(8, 8)
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.dec = block(8, 4)
        self.out = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        return self.out(self.dec(torch.cat([skip, self.up(self.mid(self.down(skip)))], 1)))


X = (1, 1, 16, 16, 16)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    model(x).float().square().mean().backward()
    module = getattr(model, "_orig_mod", model)  # a compiled model's own names
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What the step's forward saves for its backward, by shape and dtype."""
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.float().mean().backward()
    return sorted(saved, key=str)


@pytest.fixture(scope="module")
def compiled_plan() -> Plan:
    plan = remat3d.plan(_net(), X, budget="0.7x", compiled=True)
    return plan


def test_a_plan_for_compilation_is_a_graph_plan_compiled_by_inductor(compiled_plan) -> None:  # type: ignore[no-untyped-def]
    plan = compiled_plan
    assert plan.graph_recompute and plan.graph_backend == "inductor"
    assert plan.verified_peak_bytes is not None and plan.verified_peak_bytes <= plan.budget_bytes
    assert "compiled by inductor" in plan.summary()
    assert Plan.from_dict(plan.to_dict()) == plan
    # planned for eager steps, the same search runs its graphs op by op
    eager = remat3d.plan(_net(), X, budget="0.7x")
    assert eager.graph_backend == "eager" and eager.graph_recompute == plan.graph_recompute


def test_the_compiled_step_saves_what_the_plan_keeps_and_keeps_compiles_gradients(
        compiled_plan) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(X)
    eager_plan = dataclasses.replace(compiled_plan, graph_backend="eager")
    compiled = remat3d.apply(_net(), compiled_plan)
    op_by_op = remat3d.apply(_net(), eager_plan)
    # inductor fuses inside the graphs; what the forward saves is the plan's
    assert _saved_bytes(compiled, x) == _saved_bytes(op_by_op, x)
    torch._dynamo.reset()
    reference = torch.compile(_net())  # the unplanned model, compiled by torch
    expected = _grads(reference, x)
    got = _grads(compiled, x)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)
    # eager's bits are not promised, but the op-by-op run is eager's
    for name, grad in _grads(op_by_op, x).items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)


def test_torch_compile_around_a_compiled_graph_plan_adds_nothing(compiled_plan) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(X)
    model = remat3d.apply(_net(), compiled_plan)
    alone = _grads(model, x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 0 and not explained.break_reasons  # left to the plan
    torch._dynamo.reset()
    wrapped = _grads(torch.compile(model), x)
    assert all(torch.equal(wrapped[n], g) for n, g in alone.items())
    remat3d.remove(model)
    assert "forward" not in model.__dict__


def test_a_step_inductor_cannot_compile_runs_op_by_op_with_one_warning(
        compiled_plan, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from torch._inductor import compile_fx

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr(compile_fx, "compile_fx_inner", refuse)
    x = torch.randn(X)
    model = remat3d.apply(_net(), compiled_plan)
    with pytest.warns(RuntimeWarning, match="no lowering for this op.*op by op"):
        got = _grads(model, x)
    expected = _grads(remat3d.apply(_net(), dataclasses.replace(compiled_plan,
                                                                graph_backend="eager")), x)
    assert all(torch.equal(got[n], g) for n, g in expected.items())  # the op-by-op run


def test_a_compiled_graph_plan_is_measured_on_meta_as_planned(compiled_plan) -> None:  # type: ignore[no-untyped-def]
    model = remat3d.apply(_net(), compiled_plan)
    measured = remat3d.measure(model, X, device="meta")
    assert measured.peak_bytes == compiled_plan.verified_peak_bytes


def test_an_unknown_graph_backend_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match="'tvm'.*'eager'.*'inductor'"):
        Plan(graph_recompute=["convolution"], graph_backend="tvm")
    from remat3d.runtime.graph_run import apply_graph_plan

    with pytest.raises(PlanError, match="'tvm'"):
        apply_graph_plan(copy.deepcopy(_net()), [], backend="tvm")


def test_a_call_without_grad_runs_the_models_own_forward_compiled(compiled_plan) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(2, 1, 8, 8, 8)  # another shape: inference is not the planned step
    model = remat3d.apply(_net(), compiled_plan)
    torch._dynamo.reset()
    with torch.no_grad():
        got = model(x)
        expected = _net()(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert model._remat3d_graph_plan._inference is not None  # compiled by torch


# -m slow (about a minute on 2 cores: three processes compile the plan's graphs)
@pytest.mark.slow
def test_ddp_around_a_compiled_graph_plan_equals_one_accumulating_process(tmp_path) -> None:
    """nnU-Net v2's trainer under DDP: a plan for compilation applied, the model compiled,
    then wrapped in DDP. The inductor-compiled backward feeds DDP's gradient hooks like
    any step: two processes' averaged gradients are one process's over both volumes, bit
    for bit, and every rank planned the same graph plan."""
    from pathlib import Path

    from tests.runtime.torchrun import torchrun

    script = Path(__file__).parent / "ddp_graph_plan.py"
    saved = {n: torchrun(script, n, tmp_path / f"{n}.pt") for n in (1, 2)}
    for processes, got in saved.items():
        (backend, recompute), *others = got["choices"]
        assert backend == "inductor" and recompute, processes
        assert all(o == (backend, recompute) for o in others)
    single, ddp = saved[1]["grads"], saved[2]["grads"]
    assert single.keys() == ddp.keys()
    for name, grad in single.items():
        assert torch.equal(ddp[name], grad), name


def test_compile_options_are_inductors_config_while_the_graphs_compile(
        compiled_plan, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``runtime/inductor.py`` NOTE rule 5: a caller's ``torch.compile`` mode and options
    are inductor's config while the plan's graphs compile, and only then."""
    from torch._inductor import compile_fx, config

    seen: list[tuple[bool, bool, bool]] = []

    def record(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((config.max_autotune, config.coordinate_descent_tuning,
                     config.epilogue_fusion))
        raise RuntimeError("recorded")  # (the step then runs op by op, with a warning)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", record)
    model = remat3d.apply(_net(), compiled_plan, compile_options={
        "mode": "max-autotune-no-cudagraphs", "options": {"epilogue_fusion": False}})
    with pytest.warns(RuntimeWarning, match="recorded"):
        _grads(model, torch.randn(X))
    assert seen == [(True, True, False)]
    assert not config.max_autotune and config.epilogue_fusion  # as they were
    # CUDA graphs stay off whatever the process's config says
    seen_graphs: list[bool] = []

    def record_graphs(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen_graphs.append(config.triton.cudagraphs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(compile_fx, "compile_fx_inner", record_graphs)
    with config.patch({"triton.cudagraphs": True}), \
            pytest.warns(RuntimeWarning, match="recorded"):
        _grads(remat3d.apply(_net(), compiled_plan), torch.randn(X))
    assert seen_graphs == [False]
    assert not config.triton.cudagraphs  # the process's own setting again


def test_compile_options_that_cannot_hold_are_refused_by_name(compiled_plan) -> None:  # type: ignore[no-untyped-def]
    for options, match in (({"mode": "fastest"}, "'fastest'.*'max-autotune-no-cudagraphs'"),
                           ({"options": {"max_autotuning": True}}, "'max_autotuning'"),
                           ({"dynamic": True}, "'mode' and 'options'.*'dynamic'"),
                           ({"mode": "reduce-overhead"}, "CUDA graphs.*no-cudagraphs"),
                           ({"options": {"triton.cudagraphs": True}}, "CUDA graphs"),
                           ({"options": ["max_autotune"]}, "a dict of inductor options")):
        with pytest.raises(PlanError, match=match):
            remat3d.apply(_net(), compiled_plan, compile_options=options)
    eager = dataclasses.replace(compiled_plan, graph_backend="eager")
    with pytest.raises(PlanError, match="compiled=True"):
        remat3d.apply(_net(), eager, compile_options={"mode": "default"})
    module_plan = Plan(regions=[remat3d.Region("enc")])
    with pytest.raises(PlanError, match="your own torch.compile"):
        remat3d.apply(_net(), module_plan, compile_options={"mode": "default"})
