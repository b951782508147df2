"""specheads: train speculative-decoding draft heads on a frozen target; verify trees losslessly."""

__version__ = "0.1.0"
