"""Reading an answer under a tools grammar as it is decoded (``tools.AnswerStream``) and whole
(``tools.reply``): pure text, no engine."""

import json

import pytest

from dspark_edge.tools import AnswerStream, reply

COMPACT = (",", ":")
PLAIN = json.dumps({"response": 'quotes " and \\ back, tab\t, newline\n, é, 😀 and \u2028 end'}, separators=COMPACT)
CALLS = json.dumps({"tool_calls": [
    {"name": "weather", "arguments": {"city": "Paris", "when": ["today", {"hour": 9, "note": "}]\\"}]}},
    {"name": "time", "arguments": {}}]}, separators=COMPACT)


def fed(text: str, size: int) -> tuple[AnswerStream, list[tuple]]:
    stream, events = AnswerStream(), []
    for at in range(0, len(text), size):
        events += stream.feed(text[at:at + size])
    return stream, events


@pytest.mark.parametrize("ascii_only", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_a_plain_answer_streams_as_its_decoded_text_whatever_the_pieces(size, ascii_only):
    text = json.dumps(json.loads(PLAIN), separators=COMPACT, ensure_ascii=ascii_only)  # \\ud83d\\ude00 or the emoji
    stream, events = fed(text, size)
    assert stream.kind == "response" and all(kind == "content" for kind, *_ in events)
    pieces = [e[1] for e in events]
    assert "".join(pieces) == json.loads(text)["response"]
    # never half a surrogate pair or half an escape: every piece is text of its own
    assert all(p.encode("utf-8") for p in pieces)
    assert reply(text) == (json.loads(text)["response"], None)


@pytest.mark.parametrize("size", [1, 2, 4, 9, 1000])
def test_tool_calls_stream_name_first_then_arguments_in_order(size):
    stream, events = fed(CALLS, size)
    assert stream.kind == "tool_calls"
    want = json.loads(CALLS)["tool_calls"]
    names = [(e[1], e[2]) for e in events if e[0] == "call"]
    assert names == [(0, "weather"), (1, "time")]
    args: dict = {}
    named = []  # the calls named so far
    for e in events:
        assert e[0] != "content"
        if e[0] == "call":
            named.append(e[1])
        if e[0] == "arguments":
            assert named and e[1] == named[-1], "arguments before their call's name, or after a later call's"
            args[e[1]] = args.get(e[1], "") + e[2]
    assert [json.loads(args[i]) for i in sorted(args)] == [c["arguments"] for c in want]
    content, calls = reply(CALLS)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [(c["name"], c["arguments"]) for c in want]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def test_arguments_written_before_the_name_wait_for_it():
    text = json.dumps({"tool_calls": [{"arguments": {"x": [1, 2]}, "name": "f"}]}, separators=COMPACT)
    for size in (1, 3, 100):
        stream, events = fed(text, size)
        first_args = next(i for i, e in enumerate(events) if e[0] == "arguments")
        assert events.index(("call", 0, "f")) < first_args
        assert "".join(e[2] for e in events if e[0] == "arguments") == '{"x":[1,2]}'


def test_an_answer_cut_short_gives_what_it_holds():
    assert reply(PLAIN[:20]) == ("quotes ", None)  # '{"response":"quotes \\': the escape after it cut
    cut = CALLS[:CALLS.index('"hour"')]
    content, calls = reply(cut)
    assert content is None and calls[0]["function"]["name"] == "weather"
    assert calls[0]["function"]["arguments"] == cut[cut.index('{"city"'):]
    assert reply('{"tool_calls":[{"na') == ('{"tool_calls":[{"na', None)  # no call named yet: the raw text
    stream, events = fed('{"tool_calls":[{"na', 3)  # and a stream gives the same at its end
    assert events == [] and not stream.called and stream.unread == '{"tool_calls":[{"na'
    named, _ = fed('{"tool_calls":[{"name":"f","arg', 3)
    assert named.called and named.unread is None
    assert reply('{"resp') == ('{"resp', None)
    assert reply("") == ("", None)
    # cut inside an escape: nothing half-decoded comes out
    stream, events = fed('{"response":"ab\\u00', 100)
    assert "".join(e[1] for e in events) == "ab"
    assert stream.feed('e9!"}') == [("content", "é!")]
