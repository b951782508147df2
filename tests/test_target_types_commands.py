"""The commands a user runs, on every type of the target matrix: train.py trains an EAGLE-3 head on
its tiny target from the built-in data (distilled by the target itself), and infer.py answers a
prompt with it, the answer the target's own greedy one; a hybrid (a recurrent state beside
attention) refuses the default tree in one line and answers with the chain that line names.
Anything else, a traceback above all, fails. The commands run in this process, as `python train.py`
and `python infer.py` run them (runpy: their own __main__ and one-line errors)."""

import pytest
from conftest import HYBRID_TYPES, MATRIX_TYPES, run_script

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = "+model.tiny.num_hidden_layers=4"
# the built-in data kept small: 32 conversations with answers of up to 16 tokens, enough for some rows
# of a batch to finish before the others (distillation's generation then drops them from its cache)
TRAIN = [
    "head=eagle3",
    "train.max_steps=2",
    "tracker=none",
    "data.builtin_examples=32",
    "data.builtin_answer_tokens=16",
]
INFER = ["prompt=hello", "max_new_tokens=12"]


def assert_answered(run: tuple[int, str, str]) -> None:
    """Exit 0, the answer printed, and the stats line saying it is the target's own greedy one."""
    code, out, err = run
    assert code == 0 and "Traceback" not in err, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) >= 2 and "identical to plain greedy: yes" in lines[-1], out


def assert_refused_in_one_line(run: tuple[int, str, str], *words: str) -> None:
    """A non-zero exit whose stderr ends in exactly one error line (progress bars may come before it)."""
    code, out, err = run
    assert code != 0 and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-3000:]
    assert all(w in errors[0] for w in words), errors[0]


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A cache of this module's own: the built-in data is distilled and the linear kernels timed
    for each type, not read from an earlier run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECHEADS_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module", params=MATRIX_TYPES)
def trained(request, fresh_cache, tmp_path_factory):
    """(type, train.py's run, its head directory): one head per type, shared by the type's tests."""
    model_type = request.param
    out = tmp_path_factory.mktemp(model_type)
    run = run_script(
        "train.py", "model=tiny-random", f"model.path=tiny:{model_type}", TINY, *TRAIN, f"output_dir={out}"
    )
    return model_type, run, out / "head"


def test_train_py_writes_the_head(trained):
    _, (code, out, err), head = trained
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert out.strip().splitlines()[-1] == str(head) and (head / "model.safetensors").is_file()


def test_infer_py_answers_as_the_target_or_refuses_a_tree_in_one_line(trained):
    """infer.py head=DIR: the target comes from the head's record (its tiny type and sizes)."""
    model_type, (code, _, _), head = trained
    assert code == 0, "train.py failed (test_train_py_writes_the_head)"
    run = run_script("infer.py", f"head={head}", *INFER)
    if model_type in HYBRID_TYPES:
        assert_refused_in_one_line(run, model_type, "tree=chain")
        assert_answered(run_script("infer.py", f"head={head}", "tree=chain", *INFER))
    else:
        assert_answered(run)


def test_an_unknown_tiny_type_is_refused_in_one_line_naming_the_types(fresh_cache, tmp_path):
    for script, args in (("train.py", [*TRAIN, f"output_dir={tmp_path}"]), ("infer.py", ["skip.layers=auto", *INFER])):
        run = run_script(script, "model=tiny-random", "model.path=tiny:warp_moe", *args)
        assert_refused_in_one_line(run, "warp_moe", *(f"tiny:{t}" for t in MATRIX_TYPES))
