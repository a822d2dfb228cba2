"""The planner on synthetic stage models: pure Python, exhaustive checks."""

from __future__ import annotations

import ast
import itertools
import random
from pathlib import Path

import pytest

from remat3d.planner.optimal import Costs, decision_cost, min_peak, solve
from remat3d.planner.registry import PlannerOptions, get_strategy
from remat3d.planner.stages import KEEP, OFFLOAD, RECOMPUTE, SELECTIVE, Stage, StageModel

SRC = Path(__file__).resolve().parents[2] / "src" / "remat3d"


def random_model(rng: random.Random, n: int) -> StageModel:
    stages = []
    for i in range(n):
        saved = rng.randint(10, 100)
        stages.append(Stage(
            index=i, node=i, name=f"s{i}", call_index=0, saved_bytes=saved,
            input_bytes=rng.randint(1, saved), output_bytes=rng.randint(1, 20),
            fwd_flops=rng.randint(0, 1000), fwd_delta=rng.randint(0, 60),
            bwd_delta=rng.randint(0, 60), param_bytes=rng.randint(0, 5),
            is_block=rng.random() < 0.6, heavy_bytes=rng.randint(0, saved),
        ))
    pending = [rng.randint(0, 40) for _ in range(n)]  # skip connections crossing stages
    glue = list(itertools.accumulate(rng.randint(0, 5) for _ in range(n)))
    grads = list(itertools.accumulate(rng.randint(0, 5) for _ in range(n)))[::-1]
    return StageModel(stages=stages, base=rng.randint(0, 50), glue_saved=glue,
                      pending=pending, grads_after=grads)


def brute_force(model: StageModel, budget: int, offload: bool, costs: Costs):
    options = [KEEP, RECOMPUTE, SELECTIVE] + ([OFFLOAD] if offload else [])
    best = None
    for decisions in itertools.product(options, repeat=len(model.stages)):
        if model.peak(list(decisions)) > budget:
            continue
        cost = sum(decision_cost(s, d, costs) for s, d in zip(model.stages, decisions))
        if best is None or cost < best[0] - 1e-9:
            best = (cost, list(decisions))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_milp_equals_exhaustive_search_on_random_dags(seed):
    rng = random.Random(seed)
    model = random_model(rng, rng.randint(1, 5))
    offload = seed % 2 == 1
    costs = Costs(device_flops=1e3, host_bandwidth=50, memory_bandwidth=500)
    low = min(model.peak(list(d)) for d in itertools.product(
        [KEEP, RECOMPUTE, SELECTIVE] + ([OFFLOAD] if offload else []),
        repeat=len(model.stages)))
    high = model.peak([KEEP] * len(model.stages))
    for budget in sorted({low - 1, low, (low + high) // 2, high}):
        want = brute_force(model, budget, offload, costs)
        got = solve(model, budget, offload=offload, costs=costs)
        if want is None:
            assert got is None
            continue
        assert got is not None and model.peak(got) <= budget
        cost = sum(decision_cost(s, d, costs) for s, d in zip(model.stages, got))
        assert cost == pytest.approx(want[0], rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_min_peak_is_the_smallest_reachable(seed):
    rng = random.Random(100 + seed)
    model = random_model(rng, rng.randint(1, 5))
    options = [KEEP, RECOMPUTE, SELECTIVE]
    want = min(model.peak(list(d)) for d in itertools.product(options,
                                                              repeat=len(model.stages)))
    peak, decisions = min_peak(model)
    assert peak == want == model.peak(decisions)


def test_unrecomputable_stages_are_respected():
    model = random_model(random.Random(7), 4)
    ok = [True, False, True, False]
    _peak, decisions = min_peak(model, recomputable=ok)
    assert decisions[1] == KEEP and decisions[3] == KEEP


def test_strategies_from_the_registry():
    model = random_model(random.Random(3), 6)
    none = get_strategy("none")(model, None, PlannerOptions()).decisions
    assert none == [KEEP] * 6
    blocks = get_strategy("blocks")(model, None, PlannerOptions()).decisions
    assert blocks == [RECOMPUTE if s.is_block else KEEP for s in model.stages]
    selective = get_strategy("selective")(model, None, PlannerOptions())
    assert set(selective.policies.values()) <= {"save-compute-heavy"}
    with pytest.raises(Exception, match="Unknown strategy 'fastest'"):
        get_strategy("fastest")


PURE = ["graph.py", "planspec.py", "units.py", "errors.py", "decisions.py", "halo.py",
        "planner"]


def test_the_planner_never_imports_torch():
    files = [p for name in PURE for p in ((SRC / name).rglob("*.py") if (SRC / name).is_dir()
                                          else [SRC / name])]
    allowed_local = {"remat3d.graph", "remat3d.opgraph", "remat3d.planspec", "remat3d.units",
                     "remat3d.errors", "remat3d.decisions", "remat3d.halo", "remat3d.tilegraph"}
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("torch"), f"{path.name} imports {name}"
                if name.startswith("remat3d."):
                    assert name in allowed_local or name.startswith("remat3d.planner"), \
                        f"{path.name} imports {name}"


@pytest.mark.parametrize("seed", range(50))
def test_balanced_segments_differ_by_at_most_one_cost(seed):
    from remat3d.planner.segments import equal_cost

    rng = random.Random(seed)
    costs = [rng.randint(0, 100) for _ in range(rng.randint(1, 30))]
    k = rng.randint(1, 8)
    segments = equal_cost(costs, k)
    assert segments[0][0] == 0 and segments[-1][1] == len(costs)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segments))
    sums = [sum(costs[a:b]) for a, b in segments]
    assert max(sums) - min(sums) <= max(costs)


def test_equal_count_segments():
    from remat3d.planner.segments import equal_count

    assert equal_count(10, 3) == [(0, 3), (3, 7), (7, 10)]
    assert equal_count(2, 5) == [(0, 1), (1, 2)]


def test_segments_use_containers_inside_them():
    from remat3d.planner.segments import segment_regions

    model = random_model(random.Random(1), 6)
    model.containers = [("outer", 0, [0, 1, 2, 3, 4, 5]), ("left", 0, [0, 1, 2]),
                        ("right", 0, [3, 4])]
    decisions, containers = segment_regions(model, [(0, 3), (3, 6)], [True] * 6)
    assert containers == [("left", 0), ("right", 0)]
    assert decisions == [KEEP, KEEP, KEEP, KEEP, KEEP, RECOMPUTE]
