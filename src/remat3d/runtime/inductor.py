"""A graph plan's graphs compiled by inductor: the plan decides what is saved, inductor
fuses what runs.

NOTE [ Graph plans compiled by inductor ]
  1. The plan's partition function (``runtime/graph_run.py``) splits the joint graph as
     for an eager graph plan; only the two graphs it returns are compiled. Each is first
     decomposed as inductor's own pipeline decomposes a joint graph
     (``select_decomp_table``: retraced by ``make_fx`` under the graphs' fake mode; the
     plan's graph keeps eager's aten ops, which inductor lowers only decomposed), then
     handed to ``compile_fx_inner``. Inductor fuses and reorders inside a graph, but a
     graph's inputs and outputs are its own: the forward saves exactly the tensors the
     plan keeps, and the backward recomputes what the plan recomputes (fused into its
     readers where inductor can).
  2. Every output keeps the layout its fake value has (``user_visible_output_idxs``): the
     backward was compiled for the saved tensors' traced strides, and the caller gets
     eager's.
  3. Both graphs are compiled while the step is traced on fake tensors (the backward
     too, not at the first ``backward()``: ``force_non_lazy_backward_lowering``), so a
     lowering failure is the trace's :class:`~remat3d.errors.CaptureError`, raised by
     the first call, not an error inside autograd.
  4. On fake tensors (the tracing call; ``remat3d.measure`` on "meta") a graph runs op by
     op as an eager plan's does; inductor's code runs on real tensors only (its kernels
     read and write memory a fake tensor does not have).
  5. A caller's ``torch.compile`` settings (``remat3d.apply(model, plan,
     compile_options={"mode": ..., "options": {...}})``, the names ``torch.compile``
     takes; given both, the options over the mode's) are inductor's config while both
     graphs compile, and ``torch.compile``'s for a call without grad (rule 8 of
     ``graph_run.py``); an unknown mode or option is one
     :class:`~remat3d.errors.PlanError` naming where the known ones are listed. CUDA
     graphs (``reduce-overhead``, ``max-autotune``, any cudagraph option) are refused and
     kept off whatever the process's config says: their memory pool keeps every graph's
     buffers, which no plan counts; ``max-autotune-no-cudagraphs`` is the autotuning
     alone. Settings that change how inductor reuses memory (``mode="lite"``,
     ``allow_buffer_reuse``) change the compiled step's peak, which is measured, not
     verified (rule 6).
  6. What is not promised: inductor's kernels are not eager's, so gradients equal the
     compiled unplanned model's within torch.compile's own tolerance (not eager's bits);
     the verified peak is the eager graph run's, and the compiled step's is measured
     (``python -m remat3d.bench.compile_check --graph``), not verified. Recomputed
     kernels do not run inside ``is_recomputing()`` (a fused kernel cannot say which of
     its parts recompute).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import fx

from remat3d.capture.joint import run_eagerly
from remat3d.errors import PlanError
from remat3d.planspec import GRAPH_BACKENDS

__all__ = ["InductorFailure", "compiler_for", "inductor_lowering", "inductor_settings"]


class InductorFailure(Exception):
    """Inductor could not compile a graph plan's graph (the cause chained): the caller
    runs the graphs op by op instead (``runtime/graph_run.py`` NOTE rule 8)."""


def _decomposed(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
    """``gm`` retraced with inductor's decompositions (NOTE rule 1); the recomputation
    wrappers of ``mark_recomputation`` trace through to their ops."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = detect_fake_mode(example_inputs)
    context = mode if mode is not None else contextlib.nullcontext()
    with context:
        return make_fx(fx.Interpreter(gm).run,
                       decomposition_table=select_decomp_table())(*example_inputs)


def _keep_output_layouts(gm: fx.GraphModule) -> None:
    """NOTE rule 2."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output.args[0]
    output.meta["user_visible_output_idxs"] = [
        i for i, v in enumerate(values) if isinstance(v, fx.Node)]


def inductor_settings(compile_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Inductor's config for ``compile_options`` (``mode`` and ``options``, as
    ``torch.compile`` takes them; NOTE rule 5), checked."""
    from torch._inductor import list_mode_options, list_options

    given = dict(compile_options or {})
    unknown = sorted(set(given) - {"mode", "options"})
    if unknown:
        raise PlanError(f"compile_options takes 'mode' and 'options', as torch.compile "
                        f"does; got {unknown}.")
    settings: dict[str, Any] = {}
    mode = given.get("mode")
    if mode is not None:
        modes = list_mode_options()
        if mode not in modes:
            raise PlanError(f"Unknown compile mode {mode!r}; torch.compile's modes are "
                            f"{sorted(modes)}.")
        settings.update(list_mode_options(mode))
    options = given.get("options") or {}
    if not isinstance(options, Mapping):
        raise PlanError("compile_options['options'] is a dict of inductor options, as "
                        f"torch.compile takes it; got {type(options).__name__}.")
    known = set(list_options())
    wrong = sorted(k for k in options if k not in known)
    if wrong:
        raise PlanError(f"Unknown inductor option(s) {wrong}; "
                        "torch._inductor.list_options() lists them.")
    settings.update(options)
    if any("cudagraph" in key and value for key, value in settings.items()):
        raise PlanError("CUDA graphs keep every compiled graph's buffers in their own "
                        "memory pool, which the plan's verified peak does not count: use "
                        "mode='max-autotune-no-cudagraphs' (the autotuning alone) and "
                        "leave inductor's cudagraph options off.")
    settings["triton.cudagraphs"] = False  # nor from the process's own config
    return settings


def inductor_compiler(gm: fx.GraphModule, example_inputs: list,
                      settings: Mapping[str, Any] | None = None) -> Callable:
    """A boxed callable running ``gm`` compiled by inductor (its config patched with
    ``settings``, NOTE rule 5) on real tensors and op by op on fake ones (NOTE rules 1, 2
    and 4)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensor

    is_backward = any(n.op == "placeholder" and n.name.startswith("tangents")
                      for n in gm.graph.nodes)
    try:
        with config.patch(dict(settings or {})):
            decomposed = _decomposed(gm, list(example_inputs))
            _keep_output_layouts(decomposed)
            compiled = compile_fx_inner(decomposed, list(example_inputs),
                                        is_backward=is_backward)
    except Exception as exc:  # whatever inductor raises: the caller falls back, by name
        raise InductorFailure(f"{type(exc).__name__}: {exc}") from exc
    eager = run_eagerly(gm, example_inputs)

    def run(args: list) -> Any:
        if any(isinstance(a, FakeTensor) for a in args):
            return eager(args)
        return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compiler_for(backend: str, settings: Mapping[str, Any] | None = None
                 ) -> Callable[[fx.GraphModule, list], Callable]:
    """The graph compiler of ``backend`` (one of ``GRAPH_BACKENDS``); ``settings``:
    inductor's config while it compiles (``inductor_settings``)."""
    if backend == "inductor":
        return functools.partial(inductor_compiler, settings=settings)
    if backend == "eager":
        return run_eagerly
    raise ValueError(f"unknown graph backend {backend!r}; one of {GRAPH_BACKENDS}")


@contextlib.contextmanager
def inductor_lowering(backend: str) -> Iterator[None]:
    """While a step of ``backend`` is traced: its backward compiled then too (NOTE rule
    3)."""
    if backend != "inductor":
        yield
        return
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        yield
