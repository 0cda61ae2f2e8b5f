"""The OpenAI-compatible server, driven by the real ``openai`` client over loopback: answers equal
the pipeline's own, streamed and not; concurrent clients; a client that leaves mid-stream frees
the server; bad requests, a full queue, a missing key and a timeout get clear errors. Every
server runs on 127.0.0.1 in a thread of the test and stops with it; every request is bounded."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@contextlib.contextmanager
def running(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tiny_engine):
    import dspark_edge
    from dspark_edge.metrics import PrometheusMetrics
    from dspark_edge.server import ServeConfig, build_app

    pipe = dspark_edge.load(tiny_engine, "fp32", drafter="ngram")
    metrics = PrometheusMetrics()
    pipe.add_observer(metrics)
    reference = dspark_edge.load(tiny_engine, "fp32", drafter="ngram")
    app = build_app(pipe, ServeConfig(model="tiny", max_tokens=256), metrics)
    with running(app) as url:
        yield url, reference
    pipe.close()
    reference.close()


def test_chat_completion_equals_the_pipelines_answer(served):
    url, ref = served
    r = client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    want = ref.generate(MESSAGES, max_new_tokens=24)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == want.stats.prompt_tokens
    assert r.choices[0].finish_reason == ("length" if want.stop_reason == "max_new_tokens" else "stop")
    assert r.model == "tiny" and r.id.startswith("chatcmpl-")


def test_streamed_chat_and_completions_equal_the_pipelines_answers(served):
    url, ref = served
    c = client(url)
    chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == ref.generate(MESSAGES, max_new_tokens=24).text and len(chunks) > 3
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    r = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=0)
    assert r.choices[0].text == ref.generate("def add(a, b):", max_new_tokens=20).text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    counted = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    want = ref.generate(MESSAGES, max_new_tokens=24)
    # OpenAI's shape: every event has usage null but the last, which has no choices and the counts
    assert all(ch.usage is None for ch in counted[:-1]) and counted[-1].choices == []
    assert (counted[-1].usage.completion_tokens, counted[-1].usage.prompt_tokens) == (len(want.token_ids),
                                                                                       want.stats.prompt_tokens)
    assert "".join(ch.choices[0].delta.content or "" for ch in counted[:-1]) == want.text
    # the values that ask for nothing, as clients send them by default, are taken
    neutral = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=False,
                                        presence_penalty=0.0, frequency_penalty=0, response_format={"type": "text"})
    assert neutral.choices[0].message.content == ref.generate(MESSAGES, max_new_tokens=24).text
    long = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=60, temperature=0,
                                extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 60  # as llama-server and vLLM take it: decode max_tokens
    seeded = [c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.9,
                                        seed=7).choices[0].message.content for _ in range(2)]
    # a seed selects coupled sampling: the answer depends on the seed alone, not on the widths the
    # scheduler picked under whatever load the server had
    assert seeded[0] == seeded[1] == ref.generate(MESSAGES, max_new_tokens=16, temperature=0.9, seed=7,
                                                  sampling="coupled").text


def test_logprobs_are_the_pipelines_streamed_or_not(served):
    """Chat's ``logprobs``/``top_logprobs`` and the completions API's ``logprobs``: the values the
    pipeline reports for the answer's tokens (an end-of-turn token, which has no text, left out),
    the same whether streamed or not, in OpenAI's shapes."""
    url, ref = served
    c = client(url)
    want = ref.generate(MESSAGES, max_new_tokens=24, logprobs=3)
    kept = [e for e in want.logprobs if e.token_id not in ref.eos_ids]
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text and len(content) == len(kept) > 0
    for item, e in zip(content, kept):
        assert item.logprob == pytest.approx(e.logprob, abs=1e-4) and len(item.top_logprobs) == 3
        assert item.token == ref.tokenizer.decode([e.token_id], skip_special_tokens=False)
        assert item.bytes == list(item.token.encode("utf-8"))
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([lp for _, lp in e.top], abs=1e-4)
    chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True))
    streamed = [item for ch in chunks if ch.choices and ch.choices[0].logprobs
                for item in ch.choices[0].logprobs.content]
    # (the second request reuses the first's K/V, whose logits may differ in the last bits)
    assert [i.token for i in streamed] == [i.token for i in content]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content], abs=1e-4)
    plain = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None  # not asked for: none
    done = ref.generate("def add(a, b):", max_new_tokens=12, logprobs=2)
    comp = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    kept = [e for e in done.logprobs if e.token_id not in ref.eos_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in kept], abs=1e-4)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == len(kept)
    assert all(len(d) <= 2 for d in lp.top_logprobs)  # two tokens may decode to the same text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = [x for ch in c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12,
                                                 temperature=0, logprobs=2, stream=True)
                if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)
    offsets = [x for ch in c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12,
                                                temperature=0, logprobs=2, stream=True)
               if ch.choices[0].logprobs for x in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset  # counted over the whole answer, not per chunk


def test_echo_scores_the_prompt(served):
    """The completions API's ``echo`` with ``logprobs``: the prompt's text and its tokens'
    log-probabilities (the first unscored) before the answer's; ``max_tokens`` 0 scores the prompt
    alone, as evaluation harnesses ask."""
    url, ref = served
    c = client(url)
    text = "The quick brown fox jumps over the lazy dog."
    want = ref.generate(text, max_new_tokens=0, prompt_logprobs=1)
    r = c.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(want.prompt_ids) > 3
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want.prompt_logprobs[1:]], abs=1e-5)
    answered = c.completions.create(model="tiny", prompt=text, max_tokens=5, echo=True, logprobs=0, temperature=0,
                                    extra_body={"ignore_eos": True})
    alone = ref.generate(text, max_new_tokens=5, ignore_eos=True)
    assert answered.choices[0].text == text + alone.text
    assert len(answered.choices[0].logprobs.tokens) == len(want.prompt_ids) + 5
    ids = list(want.prompt_ids)  # the prompt as token ids, as evaluation harnesses send it
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert by_ids.choices[0].text == ref.tokenizer.decode(ids, skip_special_tokens=False)
    answer = c.completions.create(model="tiny", prompt=[ids], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert answer.choices[0].text == alone.text
    for body, fragment in [({"echo": True, "stream": True}, "without streaming"), ({"echo": "yes"}, "'echo' must be"),
                           ({"prompt": [1, True]}, "'prompt' must be"), ({"prompt": [10 ** 8]}, "token ids take"),
                           ({"max_tokens": 0}, "'max_tokens' must be")]:
        bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": text} | body, timeout=60)
        assert bad.status_code == 400 and fragment in bad.json()["error"]["message"]


def test_tokenize_and_detokenize(served):
    url, ref = served
    text = "The quick brown fox"
    r = httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()
    assert r["tokens"] == ref.encode_prompt(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    assert httpx.post(url + "/tokenize", json={"content": text}, timeout=30).json()["tokens"] == r["tokens"]
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == ref.encode_prompt(MESSAGES)
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["prompt"] == back["content"] == ref.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    for path, body, fragment in [("/tokenize", {"prompt": ""}, "give 'prompt'"),
                                 ("/tokenize", {"messages": [{"role": "x", "content": "y"}]}, "messages[0]"),
                                 ("/detokenize", {"tokens": [1, -2]}, "'tokens' must be"),
                                 ("/detokenize", {"tokens": "1 2"}, "'tokens' must be")]:
        bad = httpx.post(url + path, json=body, timeout=30)
        assert bad.status_code == 400 and fragment in bad.json()["error"]["message"]


def test_penalties_and_logit_bias_give_the_pipelines_answer(served):
    url, ref = served
    c = client(url)
    kw = {"presence_penalty": 0.5, "frequency_penalty": 1.0}
    r = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=0, **kw)
    assert r.choices[0].text == ref.generate("def add(a, b):", max_new_tokens=20, **kw).text
    forced = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                       logit_bias={"5": 100}, extra_body={"ignore_eos": True})
    want = ref.generate(MESSAGES, max_new_tokens=6, ignore_eos=True, logit_bias={5: 100.0})
    assert want.token_ids == (5,) * 6 and forced.choices[0].message.content == want.text


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer",
          "minimum": 0, "maximum": 9}}, "required": ["colour", "n"], "additionalProperties": False}


@pytest.mark.parametrize("parallel", [1, 3])
def test_structured_output_follows_the_schema_and_is_the_pipelines_answer(tiny_engine, parallel):
    import dspark_edge
    from dspark_edge import Grammar
    from dspark_edge.server import ServeConfig, build_app

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    asks = [("The quick brown fox", {"response_format": fmt}), ("def add(a, b):", {"response_format": fmt}),
            ("one two three", {"grammar": 'root ::= "yes" | "no"'}), ("hello", {})]
    with dspark_edge.load(tiny_engine, "fp32", drafter="ngram") as pipe:
        grammars = [Grammar.json(SCHEMA), Grammar.json(SCHEMA), Grammar.gbnf('root ::= "yes" | "no"'), None]
        # (the random tiny model pads JSON with all the whitespace the grammar allows: room for it)
        want = [pipe.generate([{"role": "user", "content": p}], max_new_tokens=256, grammar=g).text
                for (p, _), g in zip(asks, grammars)]
        app = build_app(pipe, ServeConfig(model="tiny", parallel=parallel))
        with running(app) as url:
            c, got = client(url), {}

            def ask(i):
                prompt, extra = asks[i]
                fmt = extra.get("response_format")
                rest = {k: v for k, v in extra.items() if k != "response_format"}
                r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=256, temperature=0, extra_body=rest,
                                              **({"response_format": fmt} if fmt else {}))
                got[i] = (r.choices[0].message.content, r.choices[0].finish_reason)

            threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(asks))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert [got[i][0] for i in range(len(asks))] == want
            for i in (0, 1):
                value = json.loads(got[i][0])
                assert value["colour"] in ("red", "green") and 0 <= value["n"] <= 9 and got[i][1] == "stop"
            assert got[2][0] in ("yes", "no")
            anything = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                                                 response_format={"type": "json_object"})
            assert anything.choices[0].message.content.lstrip().startswith("{")


# (small: the tiny model's context is 512 tokens of a 384-token vocabulary, and the tools are told in the prompt)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_follow_the_tools_schemas_and_come_back_as_openais_tool_calls(served):
    url, ref = served
    c = client(url)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="tiny", messages=asked, max_tokens=120, temperature=0,
                                  tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls  # parallel_tool_calls false: exactly one
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("weather", "time")
    args = json.loads(call.function.arguments)
    assert args in ([{"city": "Paris"}, {"city": "Oslo"}] if call.function.name == "weather"
                    else [{"zone": "UTC"}, {"zone": "CET"}])
    named = c.chat.completions.create(model="tiny", messages=asked, max_tokens=120, temperature=0, tools=[WEATHER, CLOCK],
                                      tool_choice={"type": "function", "function": {"name": "time"}},
                                      parallel_tool_calls=False)  # (the random tiny model would call on)
    assert {t.function.name for t in named.choices[0].message.tool_calls} == {"time"}
    # the model is told the tools and its answer is held to them: the pipeline's answer under that grammar
    from dspark_edge.tools import parse_tools, reply, with_tools

    tools = parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False})
    want = ref.generate(with_tools(asked, tools), max_new_tokens=120, grammar=tools.grammar)
    assert [c["function"]["arguments"] for c in reply(want.text)[1]] == [call.function.arguments]
    # streamed as OpenAI streams calls: the call's id and name first, then its arguments in pieces
    chunks = list(c.chat.completions.create(model="tiny", messages=asked, max_tokens=120, temperature=0, stream=True,
                                            tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False))
    deltas = [d for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls for d in ch.choices[0].delta.tool_calls]
    head, *rest = deltas
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == call.function.name
    assert head.function.arguments == "" and len(rest) >= 1 and all(d.index == 0 and d.id is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # "auto": the answer streams as it is decoded, a plain answer as its text, and assembles to
    # the answer given whole
    for choice in ("auto", "required"):
        whole = c.chat.completions.create(model="tiny", messages=asked, max_tokens=60, temperature=0,
                                          tools=[WEATHER, CLOCK], tool_choice=choice).choices[0]
        parts = list(c.chat.completions.create(model="tiny", messages=asked, max_tokens=60, temperature=0,
                                               stream=True, tools=[WEATHER, CLOCK], tool_choice=choice))
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        calls: dict = {}
        for d in (d for p in parts if p.choices for d in p.choices[0].delta.tool_calls or ()):
            calls.setdefault(d.index, ["", ""])
            calls[d.index][0] += d.function.name or ""
            calls[d.index][1] += d.function.arguments or ""
        assert (text or None) == whole.message.content and parts[-1].choices[0].finish_reason == whole.finish_reason
        assert [tuple(calls[k]) for k in sorted(calls)] == \
            [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()]
    # the call and its result go back in the history; "auto" may answer in words or call again
    history = asked + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                          "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    again = c.chat.completions.create(model="tiny", messages=history, max_tokens=120, temperature=0,
                                      tools=[WEATHER], parallel_tool_calls=False)
    choice = again.choices[0]
    assert (choice.finish_reason == "tool_calls" and choice.message.tool_calls) or \
        (choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str))
    from dspark_edge.tools import parse_tools as parse

    open_schema = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}
    strict = json.loads(parse({"tools": [open_schema]}).grammar.text)
    assert strict["anyOf"][0]["properties"]["tool_calls"]["items"]["anyOf"][0]["properties"]["arguments"][
        "additionalProperties"] is False
    plain = c.chat.completions.create(model="tiny", messages=asked, max_tokens=12, temperature=0,
                                      tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == ref.generate(asked, max_new_tokens=12).text


def test_a_conversations_next_turn_reuses_the_kv_of_the_last_and_answers_as_from_scratch(served):
    url, ref = served
    c = client(url)
    first = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    turn2 = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And then?"}]
    second = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=12, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == ref.generate(turn2, max_new_tokens=12).text
    again = c.chat.completions.create(model="tiny", messages=turn2, max_tokens=12, temperature=0,
                                      extra_body={"cache_prompt": False})  # as llama-server takes it
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == second.choices[0].message.content


def test_concurrent_clients_each_get_their_own_answer(served):
    url, ref = served
    prompts = ["The quick brown fox", "def add(a, b):", "Speculative decoding", "Une phrase"]
    got: dict = {}

    def ask(p):
        got[p] = client(url).completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert {p: ref.generate(p, max_new_tokens=20).text for p in prompts} == got


def test_a_client_leaving_mid_stream_cancels_its_request(served):
    url, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event; then the client goes away
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(url + "/metrics", timeout=10).text
        if 'stop_reason="cancelled"' in metrics and not httpx.get(url + "/health", timeout=10).json()["busy"]:
            break
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)
    r = client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert r.choices[0].message.content is not None  # the server answers the next client


@pytest.mark.parametrize("body, status, fragment", [
    ("{not json", 400, "not JSON"),
    ({"model": "tiny"}, 400, "'messages' must be"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0]"),
    ({"messages": MESSAGES, "temperature": 5}, 400, "'temperature' must be"),
    ({"messages": MESSAGES, "n": 2}, 400, "'n' must be"),
    ({"messages": MESSAGES, "max_tokens": 100000}, 400, "'max_tokens' must be"),
    ({"messages": MESSAGES, "stop": [1, 2]}, 400, "'stop' must be"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "only allowed with"),
    ({"messages": MESSAGES, "cache_prompt": "yes"}, 400, "'cache_prompt' must be"),
    # what would change the answer and is not honoured is refused by name, not ignored
    ({"messages": MESSAGES, "logprobs": 2}, 400, "'logprobs' must be true or false"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "needs \"logprobs\": true"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be"),
    ({"messages": MESSAGES, "echo": True}, 400, "'echo' belongs to /v1/completions"),
    ({"messages": MESSAGES, "presence_penalty": 2.5}, 400, "'presence_penalty' must be"),
    ({"messages": MESSAGES, "logit_bias": {"x": 1}}, 400, "'logit_bias' keys must be token ids"),
    ({"messages": MESSAGES, "logit_bias": {"5": 200}}, 400, "'logit_bias' values must be"),
    ({"messages": MESSAGES, "logit_bias": {"7": 1, "07": 2}}, 400, "names a token id twice"),
    ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, 400, "outside the vocabulary"),
    ({"messages": MESSAGES, "best_of": 3}, 400, "'best_of' is not supported"),
    ({"messages": MESSAGES, "suffix": "x"}, 400, "'suffix' is not supported"),
    ({"messages": MESSAGES, "response_format": {"type": "yaml"}}, 400, "'response_format' must be"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "needs {\"json_schema\""),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "no-such-type"}}}}, 400, "invalid json grammar"),
    ({"messages": MESSAGES, "grammar": "root ::= missing"}, 400, "invalid gbnf grammar"),
    ({"messages": MESSAGES, "grammar": 'root ::= "a"', "json_schema": {}}, 400, "send one of"),
    ({"messages": MESSAGES, "functions": [{"name": "f"}]}, 400, "'functions' is not supported"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "tools[0] must"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "twice"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "'tool_choice' must be"),
    ({"messages": MESSAGES, "tool_choice": "required"}, 400, "'tool_choice' needs 'tools'"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
      "response_format": {"type": "json_object"}}, 400, "not both"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                          "arguments": "{x"}}]}]},
     400, "are not JSON text"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "'stream_options' must"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}, 413, "bytes"),
])
def test_bad_requests_get_a_clear_error(served, body, status, fragment):
    url, _ = served
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + "/v1/chat/completions", content=data, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == status and fragment in r.json()["error"]["message"]


class BlockingPipe:
    """A stand-in pipeline whose answers wait for ``release`` (or a cancel)."""

    def __init__(self, honours_cancel: bool = True) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.honours_cancel = honours_cancel

    def stream(self, prompt, config):
        pipe = self

        class Stream:
            result = None

            def __init__(self) -> None:
                self.cancelled = threading.Event()
                self._it = self._run()

            def __iter__(self):
                return self._it

            def _run(self):
                pipe.started.set()
                yield "a"
                while not (pipe.release.is_set() or (pipe.honours_cancel and self.cancelled.is_set())):
                    time.sleep(0.01)
                yield "b"
                Stream.result = SimpleNamespace(stop_reason="cancelled" if self.cancelled.is_set() else "eos",
                                                token_ids=(1, 2), stats=SimpleNamespace(
                                                    prompt_tokens=3, tokens_per_s=1.0, draft_n=0, draft_n_accepted=0,
                                                    prompt_reused=0))
                self.result = Stream.result

            def cancel(self):
                self.cancelled.set()

            def close(self):
                self._it.close()

        return Stream()


def _ask(c, outcome, name, prompt):
    try:
        outcome[name] = c.completions.create(model="fake", prompt=prompt, max_tokens=4).choices[0].text
    except openai.APIStatusError as exc:
        outcome[name] = exc.status_code


def test_a_full_queue_answers_429():
    from dspark_edge.server import ServeConfig, build_app

    pipe = BlockingPipe()
    app = build_app(pipe, ServeConfig(model="fake", max_queue=1, request_timeout_s=60.0))
    with running(app) as url:
        c, outcome = client(url), {}
        first = threading.Thread(target=_ask, args=(c, outcome, "first", "x"), daemon=True)
        first.start()
        assert pipe.started.wait(30)
        second = threading.Thread(target=_ask, args=(c, outcome, "second", "y"), daemon=True)
        second.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=10).json()["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError, match="busy"):
            c.completions.create(model="fake", prompt="z", max_tokens=4)
        pipe.release.set()
        first.join(timeout=30)
        second.join(timeout=30)
        assert outcome == {"first": "ab", "second": "ab"}


def test_requests_past_the_timeout_get_504_running_or_queued():
    from dspark_edge.server import ServeConfig, build_app

    pipe = BlockingPipe()  # never released: the running request ends by its timeout
    app = build_app(pipe, ServeConfig(model="fake", max_queue=2, request_timeout_s=1.5))
    with running(app) as url:
        assert _running_then_queued(url, pipe) == {"running": 504, "queued": 504}
        assert not httpx.get(url + "/health", timeout=10).json()["busy"]


def _running_then_queued(url, pipe, wait_s=0.0, join_s=30.0) -> dict:
    """Ask twice: "running" (the pipe starts it) and then "queued"; after ``wait_s`` release the
    pipe. What each got: its text or its HTTP status."""
    c, outcome = client(url), {}
    threads = [threading.Thread(target=_ask, args=(c, outcome, n, n), daemon=True) for n in ("running", "queued")]
    threads[0].start()
    assert pipe.started.wait(30)
    threads[1].start()
    if wait_s:
        time.sleep(wait_s)
        pipe.release.set()
    for t in threads:
        t.join(timeout=join_s)
    return outcome


def test_a_request_that_times_out_while_queued_is_answered_when_the_worker_reaches_it():
    from dspark_edge.server import ServeConfig, build_app

    pipe = BlockingPipe(honours_cancel=False)  # the running request overstays its timeout
    app = build_app(pipe, ServeConfig(model="fake", max_queue=2, request_timeout_s=1.0))
    with running(app) as url:
        # Both deadlines pass (2.5 s) and the queued request is stopped before the worker is free;
        # each is answered well inside the 60 s a stopped running request is awaited.
        assert _running_then_queued(url, pipe, wait_s=2.5, join_s=20) == {"running": 504, "queued": 504}


def test_an_api_key_is_required_when_set():
    from dspark_edge.server import ServeConfig, build_app

    pipe = BlockingPipe()
    pipe.release.set()
    app = build_app(pipe, ServeConfig(model="fake", api_key="s3cret"))
    with running(app) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, key="wrong").completions.create(model="fake", prompt="x", max_tokens=4)
        assert client(url, key="s3cret").completions.create(model="fake", prompt="x", max_tokens=4).choices[0].text \
            == "ab"
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # no key needed
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        for path in ("/tokenize", "/detokenize"):
            assert httpx.post(url + path, json={"prompt": "x", "tokens": [1]}, timeout=10).status_code == 401


@pytest.mark.parametrize("extra", [["--drafter", "none"], ["--drafter", "auto", "--parallel", "2"],
                                   ["--drafter", "ngram", "--parallel", "2", "--no-shared-verify"]])
def test_the_serve_command_answers_and_stops_on_sigterm(tiny_engine, extra):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dspark_edge", "serve", "--engine", str(tiny_engine), "--port",
                             str(port), "--model-name", "tiny", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        assert [m.id for m in client(url).models.list().data] == ["tiny"]
        r = client(url).completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens <= 8
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in (0, 143) and "[serve] http://127.0.0.1" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_fault_in_the_pipeline_answers_500_and_the_server_goes_on():
    from dspark_edge.server import ServeConfig, build_app

    class Faulty(BlockingPipe):
        calls = 0

        def stream(self, prompt, config):
            Faulty.calls += 1
            if Faulty.calls == 1:
                raise RuntimeError("boom")
            return super().stream(prompt, config)

    pipe = Faulty()
    pipe.release.set()
    with running(build_app(pipe, ServeConfig(model="fake"))) as url:
        with pytest.raises(openai.InternalServerError, match="boom"):
            client(url).completions.create(model="fake", prompt="x", max_tokens=4)
        assert client(url).completions.create(model="fake", prompt="x", max_tokens=4).choices[0].text == "ab"



@pytest.mark.parametrize("shared_verify", [True, False])
def test_parallel_requests_are_batched_and_answered_as_alone(tiny_engine, shared_verify):
    import dspark_edge
    from dspark_edge.server import ServeConfig, build_app

    prompts = ["def add(a, b):", "The quick brown fox", "one two three", "hello"]
    with dspark_edge.load(tiny_engine, "fp32", drafter="ngram") as pipe:
        alone = [pipe.generate(p, max_new_tokens=24, ignore_eos=True, logprobs=1) for p in prompts]
        want = [r.text for r in alone]
        app = build_app(pipe, ServeConfig(model="tiny", parallel=3, shared_verify=shared_verify))
        with running(app) as url:
            c, got, logprobs = client(url), {}, {}

            def ask(i):
                r = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, temperature=0,
                                         logprobs=1, extra_body={"ignore_eos": True})
                got[i], logprobs[i] = r.choices[0].text, r.choices[0].logprobs.token_logprobs

            threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert [got.get(i) for i in range(len(prompts))] == want
            for i, r in enumerate(alone):  # batched passes report the values of the passes alone
                assert logprobs[i] == pytest.approx([e.logprob for e in r.logprobs], abs=1e-4)
            runner = app.state.worker.pipes[0]._slot[0]
            assert runner.joint == shared_verify
            assert runner.passes["batched"] + runner.passes["slots"] > 0  # the requests shared target passes
            health = httpx.get(url + "/health", timeout=10).json()
            assert health["running"] == 0 and not health["busy"]


def test_each_conversations_next_turn_goes_back_to_the_slot_that_keeps_it(tiny_engine):
    import dspark_edge
    from dspark_edge.server import ServeConfig, build_app

    conversations = [[{"role": "user", "content": "The quick brown fox"}],
                     [{"role": "user", "content": "Speculative decoding verifies them"}]]
    with dspark_edge.load(tiny_engine, "fp32", drafter="ngram") as pipe:
        app = build_app(pipe, ServeConfig(model="tiny", parallel=2))
        with running(app) as url:
            c = client(url)
            ask = lambda msgs: c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,  # noqa: E731
                                                         temperature=0)
            firsts = [ask(conv) for conv in conversations]  # the second keeps off the first's slot
            seconds = []
            for conv, first in zip(conversations, firsts):
                conv += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And then?"}]
                seconds.append(ask(conv))
            slots = app.state.worker.pipes
            assert sorted(p.kept_length > 0 for p in slots) == [True, True]
        for conv, first, second in zip(conversations, firsts, seconds):
            assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
            assert second.choices[0].message.content == pipe.generate(conv, max_new_tokens=10).text


def test_parallel_must_be_in_range():
    from dspark_edge.errors import ConfigError
    from dspark_edge.server import ServeConfig

    with pytest.raises(ConfigError, match="--parallel"):
        ServeConfig(model="x", parallel=0)
