"""Building blocks that change what a network keeps for backward.

Reversible couplings (:class:`AdditiveCoupling`, :class:`AffineCoupling`) rebuild their
input from their output; a :class:`ReversibleSequence` of them keeps only its final output,
so activation memory stops growing with depth. :class:`RevUNet` is a partially reversible
3D U-Net built from them (the ``revunet`` preset of :mod:`remat3d.zoo`).
"""

from remat3d.nn.coupling import (
    AdditiveCoupling,
    AffineCoupling,
    Coupling,
    ReversibleBlock,
    ReversibleError,
)
from remat3d.nn.revunet import RevUNet
from remat3d.nn.sequence import ReversibleSequence

__all__ = [
    "AdditiveCoupling",
    "AffineCoupling",
    "Coupling",
    "RevUNet",
    "ReversibleBlock",
    "ReversibleError",
    "ReversibleSequence",
]
