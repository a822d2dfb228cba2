import pytest
import torch
from torch import nn

from remat3d.errors import WeightsError
from remat3d.train import apply_freeze, load_pretrained, read_state_dict


def net(head: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 4, 3), nn.BatchNorm3d(4), nn.Conv3d(4, head, 1))


@pytest.mark.parametrize("wrap", [
    lambda sd: sd,
    lambda sd: {"state_dict": sd, "epoch": 3, "hyper_parameters": {"lr": 0.1}},
    lambda sd: {"model": {f"module.{k}": v for k, v in sd.items()}},
    lambda sd: {"network_weights": {f"_orig_mod.{k}": v for k, v in sd.items()}},
    lambda sd: {"state_dict": {f"model.module.{k}": v for k, v in sd.items()}},
    lambda sd: {k.replace("0.", "0._checkpoint_wrapped_module.", 1): v for k, v in sd.items()},
], ids=["plain", "lightning", "ddp", "nnunet-compiled", "lightning-ddp", "act-ckpt-wrapper"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt"])
def test_containers_and_prefixes(tmp_path, wrap, suffix):
    source = net()
    path = tmp_path / f"w{suffix}"
    torch.save(wrap(source.state_dict()), path)
    target = nn.Sequential(nn.Conv3d(1, 4, 3), nn.BatchNorm3d(4), nn.Conv3d(4, 2, 1))
    report = load_pretrained(target, path)
    assert not report.missing and not report.unexpected and not report.mismatched
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_safetensors(tmp_path):
    from safetensors.torch import save_file

    source = net()
    save_file({f"module.{k}": v.contiguous() for k, v in source.state_dict().items()},
              str(tmp_path / "w.safetensors"))
    target = net()
    for p in target.parameters():
        p.data.zero_()
    report = load_pretrained(target, tmp_path / "w.safetensors")
    assert report.stripped == ["module."] and len(report.loaded) == len(source.state_dict())
    assert torch.equal(target[0].weight, source[0].weight)


def test_new_head_is_reported_not_refused(tmp_path):
    torch.save(net(head=5).state_dict(), tmp_path / "w.pt")
    target = net(head=3)
    head_before = target[2].weight.clone()
    report = load_pretrained(target, tmp_path / "w.pt")
    assert set(report.mismatched) == {"2.weight", "2.bias"}
    assert report.mismatched["2.weight"] == ((5, 4, 1, 1, 1), (3, 4, 1, 1, 1))
    assert torch.equal(target[2].weight, head_before)
    assert "shape mismatch, kept the model's: 2.weight" in str(report)


def test_missing_and_unexpected_keys(tmp_path):
    sd = net().state_dict()
    sd.pop("1.running_var")
    sd["extra.weight"] = torch.zeros(1)
    torch.save(sd, tmp_path / "w.pt")
    report = load_pretrained(net(), tmp_path / "w.pt")
    assert report.missing == ["1.running_var"] and report.unexpected == ["extra.weight"]


def test_unreadable_files(tmp_path):
    with pytest.raises(WeightsError, match="do not exist"):
        read_state_dict(tmp_path / "nope.pt")
    torch.save(net().state_dict(), tmp_path / "w.pt")
    raw = (tmp_path / "w.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(WeightsError, match=r"Cannot read .*cut\.pt.*truncated"):
        read_state_dict(tmp_path / "cut.pt")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(WeightsError, match=r"cut\.safetensors"):
        read_state_dict(tmp_path / "cut.safetensors")
    torch.save({"epoch": 1, "note": "no weights"}, tmp_path / "empty.pt")
    with pytest.raises(WeightsError, match="holds no state dict"):
        read_state_dict(tmp_path / "empty.pt")


def test_weights_for_another_architecture(tmp_path):
    torch.save(nn.Linear(3, 3).state_dict(), tmp_path / "w.pt")
    with pytest.raises(WeightsError, match="None of the 2 tensors .* fits"):
        load_pretrained(nn.Sequential(nn.Conv3d(1, 2, 3)), tmp_path / "w.pt")


def test_freeze_and_unfreeze_patterns():
    model = net()
    frozen = apply_freeze(model, ["0.*", "1.*"], ["1.bias"])
    assert frozen == ["0.weight", "0.bias", "1.weight"]
    assert [p.requires_grad for p in model.parameters()] == [False, False, False, True, True,
                                                              True]
    with pytest.raises(WeightsError, match=r"'encoder\.\*' matches no parameter"):
        apply_freeze(model, ["encoder.*"], [])
