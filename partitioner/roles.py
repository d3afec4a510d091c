"""What a parameter is to the 4D algorithm: its role, decided by the layout pass. Pure.

Example:
    >>> ParamRole.NORMAL == "normal", str(ParamRole.FOLLOWS_ACTIVATION)
    (True, 'follows activation')
"""

from __future__ import annotations

import enum


class ParamRole(str, enum.Enum):
    """The role of a parameter (compares equal to its text, e.g. ``"normal"``)."""

    #: a layer weight whose input features are split over y, output features over x
    NORMAL = "normal"
    #: a layer weight with x and y swapped (the next layer after a normal one)
    TRANSPOSED = "transposed"
    #: takes the layout of the activation it meets (biases, norm scales, embeddings)
    FOLLOWS_ACTIVATION = "follows activation"
    #: kept whole on every device
    REPLICATED = "replicated"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of_layer(cls, in_axis: str) -> ParamRole:
        """NORMAL when the layer's input features are split over y, else TRANSPOSED."""
        return cls.NORMAL if in_axis == "y" else cls.TRANSPOSED


#: primitives whose parameter operand is a weight split over z as well (depth)
DEPTH_SPLIT_PRIMITIVES = frozenset({"dot_general", "gather", "conv_general_dilated"})
