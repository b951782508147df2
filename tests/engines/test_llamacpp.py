"""`make engines`, llama.cpp's part (engines/llamacpp.py): reading llama.cpp's logs, the acceptance
it counts, the identity and near-tie rules (always), and its refusals without a built llama.cpp."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from specheads.errors import SpecHeadsError

TOOL = Path(__file__).resolve().parents[2] / "engines" / "llamacpp.py"
sys.path.insert(0, str(TOOL.parent))
_spec = importlib.util.spec_from_file_location("engines_llamacpp", TOOL)
llamacpp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llamacpp)

# Lines as llama.cpp b11434 prints them (llama-completion --verbose-prompt; llama-speculative-simple -v).
COMPLETION_LOG = """0.00.611.360 I llama_completion: prompt: '<|im_start|>user
0.00.611.390 I llama_completion: number of tokens in prompt = 4
0.00.611.408 I      1 -> '<|im_start|>'
0.00.611.426 I   4093 -> 'user'
0.00.611.443 I    198 -> '
'
0.00.611.459 I   2683 -> 'You'
0.00.611.476 I    359 -> ' are'
0.01.004.464 I common_perf_print: prompt eval time =     307.55 ms /    54 tokens (    5.70 ms per token, ...)
0.01.004.477 I common_perf_print:        eval time =     370.63 ms /    31 runs   (   11.96 ms per token, ...)
"""
SPECULATIVE_LOG = """0.01.182.703 D accepted 0/3 draft tokens, the last target token is: (198)
0.01.237.913 D accepted 2/3 draft tokens, the last target token is: (1653)
0.01.291.569 D accepted 3/3 draft tokens, the last target token is: (1041)
0.01.301.569 D accepted 1/1 draft tokens, the last target token is: (1041)
0.02.430.528 I decoded   10 tokens in    1.314 seconds, speed:   25.117 t/s
0.02.430.528 I
0.02.430.528 I n_draft   = 3
0.02.430.529 I n_predict = 10
0.02.430.529 I n_drafted = 10
0.02.430.529 I n_accept  = 6
"""


def test_prompt_tokens_are_read_as_llamacpp_printed_them():
    # the newline piece spans two lines; the count stops the list before anything else
    assert llamacpp.prompt_tokens(COMPLETION_LOG) == [1, 4093, 198, 2683]
    with pytest.raises(SpecHeadsError, match="no prompt tokens"):
        llamacpp.prompt_tokens("nothing here")


def test_plain_timing_reads_the_one_token_evaluations_not_the_prompt():
    assert llamacpp.plain_stats(COMPLETION_LOG) == {"runs": 31, "seconds": pytest.approx(0.37063)}
    with pytest.raises(SpecHeadsError, match="no eval time"):
        llamacpp.plain_stats(COMPLETION_LOG.splitlines()[-2])  # the prompt's line alone


def test_speculative_counters_and_per_verification_acceptance():
    stats = llamacpp.speculative_stats(SPECULATIVE_LOG)
    assert stats["accepted"] == [0, 2, 3, 1]
    assert (stats["n_predict"], stats["n_drafted"], stats["n_accept"], stats["decoded"]) == (10, 10, 6, 10)
    # tokens per target forward: 10 tokens over 4 verifications, the last draft cut short
    assert llamacpp.mean_acceptance_length(stats["accepted"]) == pytest.approx(2.5)
    assert llamacpp.mean_acceptance_length(stats["accepted"]) == stats["n_predict"] / len(stats["accepted"])
    assert llamacpp.mean_acceptance_length([]) is None
    # the per-verification lines must add up to llama.cpp's own counter
    with pytest.raises(SpecHeadsError, match="do not add up"):
        llamacpp.speculative_stats(SPECULATIVE_LOG.replace("accepted 3/3", "accepted 2/3"))


def test_answer_text_drops_either_rendering_of_the_prompt_and_the_end_mark():
    shown = ["<|im_start|>user\nHi<|im_end|>\n", "user\nHi\n"]
    assert llamacpp.answer_text("\n\n<|im_start|>user\nHi<|im_end|>\nHello there\n\n", shown) == "Hello there"
    assert llamacpp.answer_text("user\nHi\nHello there [end of text]\n", shown) == "Hello there"
    with pytest.raises(SpecHeadsError, match="does not start with the prompt"):
        llamacpp.answer_text("something else", shown)


def test_same_answer_allows_a_longer_speculative_tail_only():
    assert llamacpp.same_answer("The sky is blue because", "The sky is blue")
    assert llamacpp.same_answer("The sky", "The sky is blue")
    assert not llamacpp.same_answer("The sky is red", "The sky is blue")


def test_first_difference():
    assert llamacpp.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert llamacpp.first_difference([1, 2], [1, 2, 3]) is None


def test_a_near_tie_needs_the_pair_on_top_and_a_small_relative_gap():
    logits = torch.tensor([0.0, 20.0, 19.9, 5.0])
    tie = llamacpp.tie_gap(logits, 1, 2)
    assert tie["near_tie"] and tie["top_two_are_the_pair"]
    assert tie["gap"] == pytest.approx(0.1, rel=1e-4) and tie["relative_gap"] == pytest.approx(0.005, rel=1e-4)
    # the same pair far apart is no tie; nor is a pair that is not the top two
    assert not llamacpp.tie_gap(torch.tensor([0.0, 20.0, 15.0, 5.0]), 1, 2)["near_tie"]
    not_top = llamacpp.tie_gap(logits, 1, 3)
    assert not not_top["near_tie"] and not not_top["top_two_are_the_pair"]


def test_summary_counts_identity_agreement_and_speed():
    class Args:
        k = [1, 3]
        max_new_tokens = 8

    def run(accepted, identical=True, near=None):
        return {"accepted": accepted, "decoded": 8, "seconds": 1.0, "identical": identical, "difference": near}

    rows = [
        {"plain": {"runs": 40, "seconds": 1.0}, "k": {1: run([1, 0, 1]), 3: run([3, 1])}},
        {"plain": {"runs": 40, "seconds": 1.0}, "k": {1: run([0, 0]), 3: run([2], False, {"near_tie": True})}},
    ]
    out = llamacpp.summarize(rows, {1: 1.4, 3: 3.5}, Args())
    assert out["plain_tokens_per_s"] == 40 and out["max_new_tokens"] == 8  # the caption names the budget
    k1, k3 = out["by_k"][1], out["by_k"][3]
    assert k1["llama_acceptance"] == pytest.approx(1.4) and k1["agree"] and k1["identical"] == 2
    assert k3["llama_acceptance"] == pytest.approx(3.0) and k3["agree"] is False  # 0.5 apart
    assert (k3["identical"], k3["near_ties"]) == (1, 1)
    assert k3["tokens_per_s"] == 8 and k3["vs_plain"] == pytest.approx(0.2)


def test_refused_without_a_built_llamacpp(tmp_path):
    with pytest.raises(SpecHeadsError, match="make engines` builds llama.cpp"):
        llamacpp.parse_args(["--bin", str(tmp_path)])


def test_repack_is_left_off_only_where_the_amx_path_crashes():
    """auto keeps llama.cpp's default (repacked) unless the processor has AMX-INT8, whose repacked
    matmul crashes b11434; on and off are the user's; off becomes --no-repack, on adds nothing."""
    assert llamacpp.resolve_repack("auto", ["avx2", "avx512f"]) is True
    assert llamacpp.resolve_repack("auto", ["avx512f", "amx_int8", "amx_tile"]) is False
    assert llamacpp.resolve_repack("on", ["amx_int8"]) is True
    assert llamacpp.resolve_repack("off", ["avx2"]) is False
    assert llamacpp.repack_flags(False) == ["--no-repack"] and llamacpp.repack_flags(True) == []


def test_fit_line_recovers_a_line():
    a, b = llamacpp.fit_line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)


def test_cost_model_compute_bound_and_memory_bound_targets():
    """A forward of n tokens at 9 ms a token (compute-bound: verifying K+1 costs K+1 plain steps) and
    one that streams 1 GB at 10 GB/s (100 ms, whatever n up to 5): the same draft needs tau K+1-ish
    in the first and about 1 in the second."""
    by_k = {3: {"llama_acceptance": 1.9}}
    compute = llamacpp.cost_model({n: 0.009 * n for n in range(1, 6)}, 90_000_000, 20.0, by_k, {3: (10, 0.4)})
    k3 = compute["per_k"][3]
    assert k3["verify_ratio"] == pytest.approx(4.0) and k3["draft_ms"] == pytest.approx(4.0)
    assert k3["tau_needed"] == pytest.approx((0.036 + 0.004) / 0.009) and k3["tau"] == 1.9
    assert compute["per_token_ms"] == pytest.approx(9.0) and compute["fixed_ms"] == pytest.approx(0.0, abs=1e-9)
    assert compute["weights_ms"] == pytest.approx(4.5) and k3["compute_to_pay"] == pytest.approx(4 * 9.0 / 4.5)
    memory = llamacpp.cost_model({n: 0.1 + 0.001 * n for n in range(1, 6)}, 10**9, 10.0, by_k, {3: (10, 1.1)})
    assert memory["per_k"][3]["verify_ratio"] == pytest.approx(0.104 / 0.101)
    assert memory["per_k"][3]["tau_needed"] < 1.2 and memory["per_k"][3]["compute_to_pay"] < 1


@pytest.mark.parametrize("family, overrides, block_k", [("dspark", {}, 4), ("dflash2", {"selector_top_k": 4}, 3)])
def test_a_block_head_runs_its_trained_block_only(tiny_target, tmp_path, family, overrides, block_k):
    """A DFlash-family head is run at the one draft length of its trained block (llama.cpp decodes a
    block as long as its draft) with its family's --spec-type; another --k is refused in one line."""
    from specheads.config.train import HeadConfig
    from specheads.heads import build_head, save_head

    head = build_head(HeadConfig(family=family, block_size=4, **overrides), tiny_target, train_rows=8)
    save_head(head, tmp_path / "head", training={"steps": 0, "data": "none"})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("llama-completion", "llama-speculative-simple"):
        (bin_dir / tool).touch()
    args = llamacpp.parse_args(["--bin", str(bin_dir), "--head", str(tmp_path / "head")])
    assert (args.family, args.k) == (family, [block_k])
    assert llamacpp.SPEC_TYPES[family] == ("draft-dspark" if family == "dspark" else "draft-dflash")
    with pytest.raises(SpecHeadsError, match=f"at K={block_k} only") as err:
        llamacpp.parse_args(["--bin", str(bin_dir), "--head", str(tmp_path / "head"), "--k", "2"])
    assert "\n" not in str(err.value)
