import json

import pytest

from remat3d.planspec import Plan, PlanError, Region


def test_round_trip(tmp_path):
    plan = Plan(regions=[Region("enc.0", calls=[0, 2], policy="save-compute-heavy"),
                         Region("dec", segment=["1", "2"]),
                         Region("head", decision="offload", storage_dtype="bfloat16")],
                model="DynUNet", input_shapes=[[1, 1, 64, 64, 64]], amp="bf16",
                budget_bytes=2**30, predicted_peak_bytes=123)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["schema"] == "remat3d.plan/1"
    assert Plan.load(path) == plan
    text = plan.summary()
    assert "3 regions (2 recompute, 1 offload)" in text and "enc.0#0,2" in text
    assert "dec[1..2]" in text and "storage=bfloat16" in text


def test_a_graph_plan_says_which_modules_run_what_it_recomputes():
    plan = Plan(graph_recompute=["atan2_1", "cat", "convolution_1", "getitem_2", "view",
                                 "view_3"],
                graph_modules={"convolution_1": "enc.0", "atan2_1": "enc.0",
                               "getitem_2": "enc.1",
                               "view": "enc.1", "view_3": "enc.1", "cat": ""},
                model="Net")
    assert plan.recomputed_where() == [("enc.0", "convolution, atan2"), ("enc.1", "view ×2"),
                                       ("Net's own forward", "cat")]
    assert "  - recompute enc.1: view ×2" in plan.summary()
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    unknown = Plan(graph_recompute=["relu"])  # a graph captured without module names
    assert unknown.recomputed_where() == [("outside any module's forward", "relu")]
    assert Plan(regions=[]).recomputed_where() == []


@pytest.mark.parametrize("data, match", [
    ({"schema": "remat3d.plan/0", "regions": []}, "Unsupported plan schema"),
    ({"schema": "remat3d.plan/1", "regions": [], "colour": 1}, "Unknown plan field"),
    ({"schema": "remat3d.plan/1", "regions": [{"module": "a", "why": 1}]},
     "Unknown region field"),
    ({"schema": "remat3d.plan/1", "regions": [{"module": "a", "decision": "drop"}]},
     "unknown decision 'drop'"),
    ({"schema": "remat3d.plan/1", "regions": [{"module": "a", "decision": "offload",
                                               "policy": "recompute-all"}]},
     "only applies to decision 'recompute'"),
    ({"schema": "remat3d.plan/1", "regions": [], "graph_recompute": ["view"],
      "graph_modules": {"cat": ""}}, "graph_modules names nodes graph_recompute does not"),
])
def test_bad_plans(data, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data)


def test_load_errors(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
