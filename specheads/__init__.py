"""specheads: train speculative-decoding draft heads on a frozen target; verify trees losslessly.

The package's layers, lowest first. A module may import from its own layer and the layers below
it, never from a layer above, and no import cycle exists (tests/test_layers.py checks both).
"""

__version__ = "0.1.0"

LAYERS: tuple[tuple[str, ...], ...] = (
    # one-line errors, entry points, atomic writes, provenance, the float tolerance
    ("errors", "cli", "atomic", "provenance", "numerics"),
    ("config",),  # structured configs: one schema module per entry point
    # frozen target, tiny targets, chat rendering, sampling rules, process group
    ("target", "tiny", "chat_template", "sampling", "distributed"),
    ("kernels",),  # CPU kernels of decoding: the target's forward (cached under its cache root), int8 drafting
    ("heads",),  # draft-head families: build, loss, draft step, head directories
    ("data",),  # formats, chat rendering + loss masks, datasets, decontamination, features
    ("distill",),  # prompt writing and regeneration by the target
    ("decode",),  # tree, verify, kv, drafters, tree policy, speculative generation, baselines
    ("train",),  # DeepSpeed, batches, checkpoints, Trainer, train(cfg); on-policy rollouts decode
    ("export",),  # engine formats, validation, Hub
    ("bench",),  # questions, benchmark, calibration, plots, the infer.py session
    ("commands",),  # train, distill, infer, export: what the scripts and the console scripts run
)
