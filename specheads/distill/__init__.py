"""Self-distillation: prompts (data sets or Magpie) -> the frozen target's answers -> data shards."""

from .builtin import ensure_builtin_data
from .decontaminate import decontaminate, decontaminate_prompts, resolve_eval_files
from .regenerate import run_distillation

__all__ = ["decontaminate", "decontaminate_prompts", "ensure_builtin_data", "resolve_eval_files",
           "run_distillation"]
