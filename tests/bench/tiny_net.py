"""A three-block 3D network for the bench tests (plans for it are found in milliseconds)."""

from torch import nn


def _block(cin: int, cout: int, norm: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1),
                         norm(cout) if norm is nn.BatchNorm3d else nn.GroupNorm(2, cout),
                         nn.ReLU(inplace=True), nn.Conv3d(cout, cout, 3, padding=1), nn.ReLU())


def build_model(width: int = 4) -> nn.Module:
    return nn.Sequential(_block(1, width, nn.BatchNorm3d), _block(width, width, nn.GroupNorm),
                         _block(width, width, nn.GroupNorm), nn.Conv3d(width, 2, 1))
