"""The demo's streamed answer: drafted-and-accepted tokens are marked, text decodes as a whole."""

import io

from specheads.bench.demo import TokenPrinter


def test_token_printer_marks_accepted_drafts(tiny_target):
    tok = tiny_target.tokenizer
    out = io.StringIO()
    printer = TokenPrinter(tok, "brackets", out)
    ids = tok("Hello wonderful world")["input_ids"]
    printer(ids[:1], [False])
    printer(ids[1:6], [True, True, True, True, False])
    printer(ids[6:], [False] * (len(ids) - 6))
    printer.finish()
    text = out.getvalue()
    assert text.replace("«", "").replace("»", "") == "Hello wonderful world\n"
    assert text.startswith("H«ello»") and text.count("«") == 1
