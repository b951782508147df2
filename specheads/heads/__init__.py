"""Draft-head families and their registry."""

from .base import DraftHead, check_compatible
from .dflash import DFlashHead
from .dflash2 import DFlash2Head
from .dspark import DSparkHead
from .eagle import AutoregressiveHead, EagleHead
from .eagle3 import Eagle3Head
from .early_exit import EarlyExitHead
from .hydra import HydraHead
from .io import load_head, read_head_config, save_head, warm_start
from .layers import DraftCache
from .medusa import MedusaHead
from .medusa2 import Medusa2Head
from .peagle import PEagleHead
from .registry import HEADS, build_head
from .spec import HeadSpec

__all__ = [
    "HEADS",
    "AutoregressiveHead",
    "DFlash2Head",
    "DFlashHead",
    "DSparkHead",
    "DraftCache",
    "DraftHead",
    "Eagle3Head",
    "EarlyExitHead",
    "EagleHead",
    "HeadSpec",
    "HydraHead",
    "Medusa2Head",
    "MedusaHead",
    "PEagleHead",
    "build_head",
    "check_compatible",
    "load_head",
    "warm_start",
    "read_head_config",
    "save_head",
]
