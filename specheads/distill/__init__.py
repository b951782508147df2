"""Self-distillation: prompts (data sets or Magpie) -> the frozen target's answers -> data shards."""
