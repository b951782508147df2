"""Export a trained head for a serving engine (config: conf/export.yaml).

    python -m specheads.export head=runs/x/head format=eagle3 out=export/eagle3
    python -m specheads.export head=org/head format=vllm-medusa push_to_hub=true repo_id=org/head-vllm

Prints each engine's verdict, then the output directory (or the upload URL) as the last line.
"""

from specheads.export.command import export

if __name__ == "__main__":
    export()
