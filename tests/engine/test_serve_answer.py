"""dinfer.serve.answer: what a stream may send after each committed block (no server here)."""

import pytest

pytest.importorskip("fastapi")

from dinfer.llm import cut_at_stop
from dinfer.serve.answer import Answer

EOS = 0


class Bytes:
    """A byte-level tokenizer: token t is byte t - 1 (0 is EOS); what does not decode is U+FFFD."""

    def encode(self, text):
        return [b + 1 for b in text.encode()]

    def decode(self, ids):
        ids = list(ids)
        ids = ids[: ids.index(EOS)] if EOS in ids else ids
        return bytes(t - 1 for t in ids).decode("utf-8", errors="replace")


TOK = Bytes()


def stream(blocks, max_tokens=100, stops=(), finish=None):
    """(pieces sent block by block, the answer) for blocks of token ids; finish: the engine's tokens."""
    answer = Answer(TOK, EOS, max_tokens, stops)
    pieces = []
    for block in blocks:
        answer.add(block)
        pieces.append(answer.delta())
    if finish is not None:
        answer.finish(finish)
        pieces.append(answer.delta())
    return pieces, answer


def blocks_of(text, size, tail=()):
    ids = TOK.encode(text) + list(tail)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def test_pieces_are_the_new_text_of_each_block_and_end_at_eos():
    pieces, a = stream(blocks_of("hello world", 4, [EOS, EOS, EOS]))
    assert pieces == ["hell", "o wo", "rld", ""] and a.finish_reason == "stop"
    assert a.text == "hello world" and a.ids == TOK.encode("hello world")
    a.add(TOK.encode("more"))  # nothing after the end
    assert a.delta() == "" and a.text == "hello world"


def test_max_tokens_cuts_the_answer():
    pieces, a = stream(blocks_of("abcdefgh", 3), max_tokens=5)
    assert "".join(pieces) == "abcde" and a.finish_reason == "length" and len(a.ids) == 5


def test_a_stop_string_split_over_blocks_is_held_back_then_cut():
    pieces, a = stream(blocks_of("say STOP now", 5), stops=["STOP"])
    # "say S" -> "say " (the "S" may begin STOP), "TOP n" completes it: the answer ends before it
    assert pieces == ["say ", "", ""] and a.text == "say " and a.finish_reason == "stop"
    assert (a.ids, a.text) == cut_at_stop(TOK, TOK.encode("say STOP now"), ["STOP"])
    # a tail that only looked like a stop string is sent once it cannot be one
    pieces, a = stream(blocks_of("say STEP now", 5) + [[EOS]], stops=["STOP"])
    assert pieces == ["say ", "STEP n", "ow", ""] and a.text == "say STEP now"


def test_the_earliest_stop_string_wins():
    _, a = stream(blocks_of("one two three", 4, [EOS]), stops=["three", "two"])
    assert a.text == "one " and a.finish_reason == "stop"


def test_an_incomplete_utf8_character_waits_for_its_last_byte():
    text = "caf\u00e9 \u4e2d"  # 2- and 3-byte characters, split across blocks of 2 bytes
    pieces, a = stream(blocks_of(text, 2, [EOS]))
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert all(p == "" or "\ufffd" not in p for p in pieces)


def test_the_engines_last_word_completes_what_the_blocks_did_not_say():
    ids = TOK.encode("abcdef")
    pieces, a = stream([ids[:2]], finish=ids + [EOS, EOS])
    assert pieces == ["ab", "cdef"] and a.finish_reason == "stop"
    # a region that ended without EOS before max_tokens (the context's end) is a length finish
    _, a = stream([], max_tokens=10, finish=ids)
    assert a.text == "abcdef" and a.finish_reason == "length"
    # after the answer ended (a stop string, then the request was cancelled) the engine's tokens
    # (with [MASK] where nothing was committed) change nothing
    _, a = stream(blocks_of("xySTOP", 6), stops=["STOP"], finish=TOK.encode("xyzzzz"))
    assert a.text == "xy"
