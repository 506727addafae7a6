"""Every torch.library custom op fxopt's rewritten graphs call (``torch.ops.fxopt.*``). Importing
this package registers them all."""

from fxopt.ops import bits, collectives, dropout, offload, quantize  # noqa: F401
