import pytest

from remat3d.errors import SettingsError
from remat3d.train import TrainSettings, load_settings
from remat3d.train.settings import parse_overrides


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_with_overrides_and_relative_paths(tmp_path):
    path = write(tmp_path, "model: nnunet\nmodel_kwargs: {out_channels: 3, filters: [8, 16]}\n"
                           "data: data/dataset.json\nmemory_budget: 12GiB\namp: bf16\n"
                           "epochs: 10\noutput_dir: runs/exp1\nlr: 1\n")
    s = load_settings(path, ["--epochs=3", "model_kwargs.out_channels=4", "spacing=[1, 1, 2]"])
    assert s.epochs == 3 and s.amp == "bf16" and s.memory_budget == "12GiB"
    assert s.model_kwargs == {"out_channels": 4, "filters": [8, 16]}
    assert s.data == str(tmp_path / "data" / "dataset.json")
    assert s.spacing == [1.0, 1.0, 2.0] and isinstance(s.lr, float)
    assert s.to_dict()["model_kwargs"]["out_channels"] == 4


@pytest.mark.parametrize("text, overrides, message", [
    ("data: x\nepoch: 3\n", [], (r"Unknown setting 'epoch' \(from .*run.yaml\)\. Did you mean "
                                 r"'epochs'\?")),
    ("data: x\n", ["--memory-budget=1GiB"], r"Unknown setting 'memory-budget'.*memory_budget"),
    ("data: x\nepochs: three\n", [], r"epochs='three' .* should be int"),
    ("data: x\namp: fp8\n", [], r"amp='fp8' is invalid: use none, bf16 or fp16"),
    ("data: x\nobjective: memory\n", [], r"objective='memory' is invalid: use time"),
    ("data: x\nepochs: 0\n", [], r"epochs=0 is invalid"),
    ("data: x\nspacing: [1, 2]\n", [], r"spacing=\[1.0, 2.0\] is invalid"),
    ("epochs: 2\n", [], r"'data' is required"),
    ("- a\n- b\n", [], r"must hold a mapping"),
    ("data: [unclosed\n", [], r"not valid YAML"),
    ("data: x\n", ["epochs"], r"not key=value"),
])
def test_bad_settings(tmp_path, text, overrides, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(write(tmp_path, text), overrides)


def test_missing_file():
    with pytest.raises(SettingsError, match="Cannot read settings file"):
        load_settings("/nonexistent/run.yaml")


def test_overrides_parse_yaml_values():
    assert parse_overrides(["a=1", "b=[1, 2]", "c.d=x", "e=null", "f=true"]) == {
        "a": 1, "b": [1, 2], "c": {"d": "x"}, "e": None, "f": True}


def test_defaults_are_valid_once_data_is_set():
    TrainSettings(data="x").validate()


def test_a_run_saved_before_the_objective_setting_resumes_and_lr_still_may_not_change():
    from remat3d.train.settings import TrainSettings
    from remat3d.train.state import check_resumable

    now = TrainSettings(data="x").to_dict()
    saved = {k: v for k, v in now.items() if k != "objective"}  # an older run's settings
    check_resumable(saved, now)  # a plan changes memory and time, not the arithmetic
    check_resumable({**now, "objective": "flops"}, now)
    with pytest.raises(SettingsError, match="lr: saved 0.5"):
        check_resumable({**saved, "lr": 0.5}, now)
