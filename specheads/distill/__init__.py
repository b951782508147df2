"""Self-distillation: prompts (data sets or Magpie) -> the frozen target's answers -> data shards.

Names are imported lazily, so that distill.py can compose (and reject) its config without
importing torch and transformers first.
"""

import importlib

_EXPORTS = {
    "decontaminate": ".decontaminate",
    "decontaminate_prompts": ".decontaminate",
    "resolve_eval_files": ".decontaminate",
    "ensure_builtin_data": ".builtin",
    "run_distillation": ".regenerate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
