"""vLLM's extract_hidden_states dumps read as feature rows: the layer-id mapping, the final state,
the refusals, the writer's lock. The dumps are written as vLLM 0.32 writes them (tests/vllm_dumps.py),
from hooks on each layer's output; the rows they give must equal specheads' own capture."""

import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from vllm_dumps import vllm_aux_states, write_vllm_dump

from specheads.config.model import ModelConfig
from specheads.data.vllm_hidden_states import dump_states, read_dump, remove_dump, request_layer_ids
from specheads.errors import SpecHeadsError
from specheads.numerics import same_numbers
from specheads.target import load_final_norm

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [3, 17, 42, 99, 7, 250, 64, 12, 5]


def shifted_request(layer_ids, final, num_layers):
    """The off-by-one variant: asking vLLM for k + 1 (SGLang's numbering, or reading vLLM's id k
    as the output of layer k) for our layer k."""
    return sorted({int(k) + 1 for k in layer_ids} | ({num_layers} if final else set()))


@pytest.mark.parametrize("request_ids", [request_layer_ids, shifted_request], ids=["ours", "off_by_one"])
def test_a_dump_of_the_requested_layers_reads_as_the_transformers_forward(tiny_target, tmp_path, request_ids):
    """Layer ids 0 (the embeddings), a middle one and L (the last layer's output before the norm),
    plus the final state through the target's norm: equal to specheads' capture (fp32, same
    weights, so to float rounding). The variant that asks vLLM for k + 1 gives other states, and
    the same comparison fails on it."""
    num_layers = tiny_target.info.num_layers
    layers = [0, 3, num_layers]
    path = write_vllm_dump(tmp_path / "req.safetensors", tiny_target, IDS, request_ids(layers, True, num_layers))
    tensors = read_dump(path)
    assert tensors["hidden_states"].shape == (len(IDS), len(layers), tiny_target.info.hidden_size)
    assert tensors["token_ids"].dtype == torch.int64
    states = dump_states(tensors, torch.tensor(IDS), layers, True, num_layers, tiny_target.final_norm)
    own = tiny_target.states(torch.tensor([IDS]), layer_ids=layers, final=True)
    want = {f"layer_{k}": own.hidden[k][0] for k in layers} | {"final": own.final[0]}
    assert sorted(states) == sorted(want)
    same = {n: same_numbers(states[n], want[n]) for n in want}
    if request_ids is request_layer_ids:
        assert all(same.values()), same
    else:  # every layer but L (asked either way) is the next one's
        assert not same["layer_0"] and not same["layer_3"]


def test_vllm_records_ascending_layers_once_and_the_request_lists_them_so(tiny_target):
    """vLLM's loop records in layer order whatever order its config lists, one state per id: the
    request is sorted and distinct, with L added for the final state."""
    listed_backwards = vllm_aux_states(tiny_target, IDS, [5, 1, 3])
    assert torch.equal(listed_backwards, vllm_aux_states(tiny_target, IDS, [1, 3, 5]))
    assert request_layer_ids([5, 1, 3, 3], True, 6) == [1, 3, 5, 6]
    assert request_layer_ids([5, 1, 3, 6], False, 6) == [1, 3, 5, 6]
    assert request_layer_ids([2], False, 6) == [2]


def test_a_dump_of_other_layers_or_other_tokens_is_refused(tiny_target, tmp_path):
    num_layers = tiny_target.info.num_layers
    tensors = read_dump(write_vllm_dump(tmp_path / "a.safetensors", tiny_target, IDS, [1, 6]))
    with pytest.raises(SpecHeadsError, match=r"holds 2 layers where 3 were asked .*ids=\[1, 3, 6\]"):
        dump_states(tensors, torch.tensor(IDS), [1, 3], True, num_layers, tiny_target.final_norm)
    with pytest.raises(SpecHeadsError, match="other tokens than the conversation .* first difference at 2"):
        dump_states(tensors, torch.tensor(IDS[:2] + [1] + IDS[3:]), [1], True, num_layers, tiny_target.final_norm)
    save_file({"token_ids": torch.tensor(IDS)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(SpecHeadsError, match="not a vLLM hidden-states dump"):
        read_dump(tmp_path / "b.safetensors")
    with pytest.raises(SpecHeadsError, match="this process must see the server's shared_storage_path"):
        read_dump(tmp_path / "missing.safetensors")


def test_reading_waits_for_the_writers_lock_and_removing_takes_both_files(tiny_target, tmp_path):
    """vLLM answers before its writer thread has saved the file, holding `<file>.lock` exclusively
    until it has: a reader that did not wait would read a half file or none."""
    import fcntl

    path = tmp_path / "late.safetensors"
    lock = open(str(path) + ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)

    def writer():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(2, 1, 4), "token_ids": torch.tensor([1, 2])}, str(path))
        lock.close()  # releases LOCK_EX, as the connector's writer does

    threading.Thread(target=writer).start()
    assert read_dump(path)["hidden_states"].shape == (2, 1, 4)
    remove_dump(path)
    assert list(tmp_path.iterdir()) == []


def test_the_final_norm_alone_is_read_from_the_checkpoint(tiny_target, tmp_path):
    """A target served elsewhere: its final norm from a safetensors checkpoint (the model built on
    the meta device), equal to the loaded target's."""
    ckpt = tmp_path / "ckpt"
    tiny_target.model.config.save_pretrained(ckpt)
    weights = {k: v.clone().contiguous() for k, v in tiny_target.model.state_dict().items()}
    save_file(weights, str(ckpt / "model.safetensors"))  # what save_pretrained writes, minus its seconds
    norm = load_final_norm(ModelConfig(name="ckpt", path=str(ckpt)))
    assert torch.equal(norm.weight, tiny_target.final_norm.weight.float())
    last = torch.randn(5, tiny_target.info.hidden_size)
    assert torch.equal(norm(last[None])[0], tiny_target.final_norm(last[None])[0])
