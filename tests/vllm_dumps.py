"""vLLM 0.32's extract_hidden_states, played by a transformers target: its dump files and a server.

`write_vllm_dump` writes one request's file as vLLM does (see specheads.data.vllm_hidden_states):
the decoder loop records id 0 before the first layer and id i + 1 after layer i for the ids in
eagle_aux_hidden_state_layer_ids, in loop order; ExampleHiddenStatesConnector saves
{"hidden_states": torch.stack(states, dim=1) [T, n, H] in the model's dtype, "token_ids": the
prompt's ids as torch.tensor(list) (int64)} with safetensors' save_file, beside a `.lock` file. The
states come from forward hooks on the embedding and on each decoder layer's OUTPUT (not from
specheads' own capture, which hooks each layer's input and the final norm's), so a test comparing
the two compares two mechanisms.

`FakeVLLMServer` serves a target the way an extract_hidden_states vLLM server does for distill.py:
/v1/models, /version, /tokenize, and /v1/completions, which answers one token (with the top
log-probabilities when asked: the identity probe) and writes a dump of every request to its storage
directory, named in the answer's kv_transfer_params.hidden_states_path.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import torch
from json_server import NOT_FOUND, JsonServer, chat_ids
from safetensors.torch import save_file


def vllm_aux_states(target, ids: list[int], aux_layer_ids) -> torch.Tensor:
    """[T, n, H]: what vLLM's decoder loop records for `aux_layer_ids` (vLLM's numbering)."""
    decoder = target.model.get_decoder()
    wanted = set(int(k) for k in aux_layer_ids)
    seen: dict[int, torch.Tensor] = {}

    def keep(idx):
        def hook(module, args, output):
            seen[idx] = (output[0] if isinstance(output, tuple) else output)[0].detach()

        return hook

    hooks = [decoder.embed_tokens.register_forward_hook(keep(0))]
    hooks += [layer.register_forward_hook(keep(i + 1)) for i, layer in enumerate(decoder.layers)]
    try:
        with torch.no_grad():
            target.model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    # in loop order: ascending, each once, whatever the order of the config's list
    return torch.stack([seen[k] for k in range(len(decoder.layers) + 1) if k in wanted], dim=1)


def write_vllm_dump(path: Path, target, ids: list[int], aux_layer_ids, dtype=torch.float32) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(str(path) + ".lock").touch()
    tensors = {"hidden_states": vllm_aux_states(target, ids, aux_layer_ids).to(dtype), "token_ids": torch.tensor(ids)}
    save_file(tensors, str(path))
    return path


class FakeVLLMServer(JsonServer):
    """An extract_hidden_states vLLM server of `target` extracting `aux_layer_ids`."""

    def __init__(self, target, aux_layer_ids, storage: Path, model: str = "tiny", shift: int = 0, names=None):
        self.target, self.aux, self.storage, self.model, self.shift = target, list(aux_layer_ids), storage, model, shift
        self.names = names  # the path its answers name, from the path it wrote (a hostile server's)
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()
        self.start()

    def get(self, path):
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if path == "/version":
            return 200, {"version": "0.32.0"}
        return NOT_FOUND

    def post(self, path, body):
        if path == "/tokenize":
            ids = chat_ids(self.target, body["messages"], self.shift)
            return 200, {"tokens": ids, "count": len(ids)}
        if path == "/v1/completions":
            return 200, self.complete(body)
        return NOT_FOUND

    def complete(self, body):
        ids = [int(t) for t in body["prompt"]]
        with self.lock:
            self.prompts.append(ids)
            path = write_vllm_dump(self.storage / f"{uuid.uuid4().hex}.safetensors", self.target, ids, self.aux)
            with torch.no_grad():
                logits = self.target.model(input_ids=torch.tensor([ids])).logits[0, -1]
        top = torch.topk(torch.log_softmax(logits.float(), -1), int(body.get("logprobs") or 1))
        pairs = [(int(i), float(v)) for i, v in zip(top.indices, top.values)]
        logprobs = None
        if body.get("logprobs"):
            logprobs = {
                "tokens": [f"token_id:{pairs[0][0]}"],
                "token_logprobs": [pairs[0][1]],
                "top_logprobs": [{f"token_id:{i}": v for i, v in pairs}],
                "text_offset": [0],
            }
        return {
            "id": "c",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "text": "x", "logprobs": logprobs, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
            "kv_transfer_params": {"hidden_states_path": str(self.names(path) if self.names else path)},
        }
