"""vLLM's hidden-state dumps (`"method": "extract_hidden_states"`) read as our feature rows.

What vLLM 0.32 writes, read from its source (vllm/...):
  - The served target records "aux hidden states" at the layer ids of
    `speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`
    (v1/worker/gpu_model_runner.py, _get_eagle3_aux_layers_from_config). Its decoder loop
    (model_executor/models/llama.py, LlamaModel.forward, and the SupportsEagle3 mixin's
    _maybe_add_hidden_state in model_executor/models/interfaces.py) records id 0 before the first
    layer and id i + 1 after layer i, as `hidden_states + residual`: the residual stream ENTERING
    layer k, and for k = L the last layer's output before the final norm. That is our convention
    (specheads.target.LAYER_CONVENTION) id for id: no shift. transformers' `hidden_states[k]` is
    the same state for k < L, but its `hidden_states[L]` is AFTER the final norm (our "final"), and
    SGLang's ids are ours + 1.
  - The states are recorded in the loop's order, so they come in ascending layer order whatever
    order the config lists them in, and a repeated id is recorded once (while vLLM sizes its buffer
    by the list's length): a request must list sorted, distinct ids (`request_layer_ids`).
  - The post-norm state is not among them: the final state is layer L's through the target's own
    final norm (`final_from_last_layer`).
  - ExampleHiddenStatesConnector (distributed/kv_transfer/kv_connector/v1/
    example_hidden_states_connector.py) saves one safetensors file per request with
        hidden_states [T, n, H]  (the model's dtype; axis 1 in ascending layer-id order)
        token_ids     [T] int64  (the prompt's token ids: the positions whose states are saved)
    T covers the prompt only (a generated token was never a forward's input; with
    kv_transfer_params include_output_tokens all but the last token). Its path comes back in the
    response's kv_transfer_params["hidden_states_path"]; `<path>.lock` is held exclusively until the
    file is written (load_hidden_states takes a shared lock to wait for it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import SpecHeadsError

HIDDEN_STATES = "hidden_states"
TOKEN_IDS = "token_ids"
LOCK_SUFFIX = ".lock"
# how vLLM's layer ids relate to ours (specheads.target.LAYER_CONVENTION): equal, see above
VLLM_LAYER_OFFSET = 0


def request_layer_ids(layer_ids: Iterable[int], final: bool, num_layers: int) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` to ask vLLM for: the layers to cache in vLLM's
    numbering (ours + VLLM_LAYER_OFFSET), plus the last layer's output when the final state is
    wanted (it is computed from that one), sorted and distinct as vLLM records them."""
    ids = {int(k) for k in layer_ids} | ({num_layers} if final else set())
    return sorted(k + VLLM_LAYER_OFFSET for k in ids)


def read_dump(path: str | os.PathLike, wait: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of one dump, after vLLM's writer has released its lock (where there is one)."""
    path = Path(path)
    lock = Path(str(path) + LOCK_SUFFIX)
    with open(lock) if wait and lock.exists() else contextlib.nullcontext() as held:
        if held is not None:
            fcntl.flock(held, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
        if not path.is_file():
            raise SpecHeadsError(
                f"vLLM's hidden-states file {path} is missing: the server writes it on its own disk, "
                "so this process must see the server's shared_storage_path at the same path"
            )
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as err:  # safetensors raises its own error types for a truncated or foreign file
            raise SpecHeadsError(f"{path} is not a readable safetensors file ({err})") from None
    missing = [k for k in (HIDDEN_STATES, TOKEN_IDS) if k not in tensors]
    if missing:
        raise SpecHeadsError(f"{path} is not a vLLM hidden-states dump (no {', '.join(missing)})")
    return tensors


def confined_dump(path: str | os.PathLike, storage: str | os.PathLike) -> Path:
    """The dump a server's answer names, refused in one line unless it is a `.safetensors` file
    directly or below `storage` once links and `..` are resolved: the answer decides which file is
    read and then deleted, so it must not be able to name one outside the connector's directory."""
    root = Path(storage).resolve()
    where = Path(path).resolve()
    if where.suffix != ".safetensors" or not where.is_relative_to(root) or where == root:
        raise SpecHeadsError(
            f"the server named the hidden-states file {str(path)!r}, which is not a .safetensors file inside "
            f"distill.features.storage={str(storage)!r}: nothing was read or deleted"
        )
    return where


def remove_dump(path: str | os.PathLike) -> None:
    """Deletes a dump and its lock; `path` must already be confined (confined_dump)."""
    for p in (Path(path), Path(str(path) + LOCK_SUFFIX)):
        p.unlink(missing_ok=True)


def final_from_last_layer(last: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """The post-norm state (what the LM head reads) from layer L's: the target's own final norm
    module, run in its parameters' dtype."""
    dtype = next(norm.parameters()).dtype
    with torch.no_grad():
        return norm(last.to(dtype).unsqueeze(0))[0]


def dump_states(
    tensors: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    layer_ids: Iterable[int],
    final: bool,
    num_layers: int,
    norm: torch.nn.Module | None = None,
    where: str = "vLLM's dump",
) -> dict[str, torch.Tensor]:
    """One conversation's states as the feature cache names them (layer_<k> [T, H], final [T, H]),
    from a dump of `request_layer_ids(layer_ids, final, num_layers)`; refuses a dump of other
    tokens or another number of layers in one line."""
    asked = request_layer_ids(layer_ids, final, num_layers)
    hidden, tokens = tensors[HIDDEN_STATES], tensors[TOKEN_IDS].long()
    ids = input_ids.long().cpu()
    if hidden.dim() != 3 or hidden.shape[0] != tokens.shape[0]:
        raise SpecHeadsError(f"{where}: hidden_states {list(hidden.shape)} is not [tokens, layers, hidden]")
    if hidden.shape[1] != len(asked):
        raise SpecHeadsError(
            f"{where} holds {hidden.shape[1]} layers where {len(asked)} were asked for "
            f"(vLLM ids {asked}): the server extracts other layers; start it with "
            f"eagle_aux_hidden_state_layer_ids={asked}"
        )
    if not torch.equal(tokens, ids):
        at = next((i for i, (a, b) in enumerate(zip(tokens.tolist(), ids.tolist())) if a != b), None)
        raise SpecHeadsError(
            f"{where} covers other tokens than the conversation ({tokens.numel()} vs {ids.numel()} tokens"
            + (f", first difference at {at})" if at is not None else ")")
        )
    column = {k - VLLM_LAYER_OFFSET: i for i, k in enumerate(asked)}
    states = {f"layer_{int(k)}": hidden[:, column[int(k)]] for k in sorted({int(k) for k in layer_ids})}
    if final:
        if norm is None:
            raise ValueError("the final state needs the target's final norm")
        states["final"] = final_from_last_layer(hidden[:, column[num_layers]], norm)
    return states
