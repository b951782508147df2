"""The CPU kernels of infer.py's forward path.

`linear_layout`: the linear kernel measured fastest on this machine per row count (stock,
weight-left or oneDNN-packed). `gqa_attention`: masked SDPA that keeps grouped-query KV heads
unrepeated. Both patch a loaded target in place and can be suspended (`stock_kernels`,
`stock_attention`) for the HF baselines.
"""
