"""An OpenAI-compatible HTTP server over one pipeline (``python -m dspark_edge serve``).

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize``,
``GET /health`` and ``GET /metrics`` (the
pipeline's Prometheus counters and the server's own). Built on Starlette; ``serve`` runs it
with uvicorn.

Requests wait in a bounded queue, in arrival order. With ``parallel`` 1, one worker thread
decodes them one at a time on the pipeline, with its drafter and scheduler: the answers are
exactly what ``Pipeline.generate`` gives for the same request. With ``parallel`` N, N threads
decode up to N requests at once on the slots of ``Pipeline.batch_slots`` (continuous batching:
each round's target passes of all requests run as one, several requests' drafts verified
together unless ``shared_verify`` is off, when a request drafts only while it is the only one
decoding); greedy answers are still the pipeline's own. A full queue answers 429; a client that goes away (while queued or while
its answer streams) cancels its request, which ends after the round in progress; a request
running past ``request_timeout_s`` ends the same way and is answered 504 (or, mid-stream, with
an error event). Bad requests get 400 with the field and the fix, in OpenAI's error shape.
With ``api_key`` set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
With ``prompt_cache`` (the default) a request starts from the K/V the previous one on its
pipeline or slot left for the prefix their prompts share (a conversation's next turn prefills
its new message only; ``usage.prompt_tokens_details.cached_tokens`` says how many were reused);
with ``parallel`` N, each request goes to the idle slot that keeps most of its prompt. Asked
for (chat's ``logprobs``/``top_logprobs``, the completions API's ``logprobs``), each answer
token's log-probability under the target's distribution and the likeliest tokens there come
with the answer or with the chunk that streams it (``GenerationConfig.logprobs``); the
completions API's ``echo`` adds the prompt and its tokens' (not streamed). Presence and
frequency penalties and a logit bias reshape the target's distribution (``GenerationConfig``).
Structured output: ``response_format`` (``json_object``, ``json_schema``), or llama-server's
``json_schema`` and ``grammar`` (GBNF) fields, constrain the answer (``GenerationConfig.grammar``);
chat's ``tools`` and ``tool_choice`` become a grammar too (``tools``), and the answer tool calls.

What this module does not know: how the pipeline decodes (it only calls ``stream``), and how
it is run (``cli/serve.py`` binds it to a host and port).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from .config import MAX_TOP_LOGPROBS, GenerationConfig
from .errors import ConfigError, DSparkError
from .grammar import Grammar
from .tools import AnswerStream, ToolError, Tools, call_id, history_message, parse_tools, reply, with_tools

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
STUCK_S = 60.0  # after a timed-out job's stop, how long its end is awaited
FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context_full": "length"}


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the id /v1/models lists and responses carry
    max_queue: int = 8  # requests waiting beyond the one being decoded
    request_timeout_s: float = 600.0  # queueing and decoding together
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256
    api_key: str | None = None
    parallel: int = 1  # requests decoded at once (batched when more than 1)
    shared_verify: bool = True  # batched requests' drafts verified in one pass (a second graph session)
    # A request starts from the K/V the last one on its pipeline or slot left for the prefix
    # their prompts share (GenerationConfig.reuse_prefix); a request's "cache_prompt" overrides it.
    prompt_cache: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.parallel <= 64:
            raise ConfigError(f"serve: --parallel must be between 1 and 64, got {self.parallel}")
        if self.max_queue < 1 or self.request_timeout_s <= 0 or not 1 <= self.default_max_tokens <= self.max_tokens:
            raise ConfigError("serve: --max-queue must be at least 1, --request-timeout positive, and the default "
                              "max_tokens between 1 and --max-tokens")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# --- request parsing ---------------------------------------------------------------------------
# OpenAI fields that would change the answer and that this server does not honour, with the
# values that ask for nothing (what OpenAI's clients send by default): another value is refused
# by name rather than ignored, so a client never takes an answer for what it did not ask.
UNHONOURED = {
    "suffix": (None, ""),
    "best_of": (None, 1), "functions": (None, []), "function_call": (None, "none"),
}


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind} in [{low}, {high}], got {value!r}", name)
    return value


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality with true and false apart from 1 and 0 (0 and 0.0 alike)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return value == neutral


def parse_request(body: Any, chat: bool, cfg: ServeConfig) -> tuple[Any, GenerationConfig, bool, bool, bool,
                                                                    Tools | None]:
    """(prompt, generation config, stream, include_usage, echo, tools) of an OpenAI request body, every
    field it uses checked. ``ignore_eos`` (as llama-server and vLLM take it) decodes ``max_tokens``
    whatever the model says, for benchmarks. ``stream_options.include_usage`` (streams only, as
    OpenAI's API has it) adds a last event with the token counts and no choices. Log-probabilities
    (``_logprobs_wanted``), ``echo`` (``_echo``), the penalties and ``logit_bias`` (``_logit_bias``)
    go into the generation config. Fields that would
    change the answer and are not honoured (``UNHONOURED``: suffix, best_of, tools, …) are
    refused unless they ask for nothing; fields that do not change it (``model``, ``user``, …)
    are ignored."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        prompt = []
        try:
            tools = parse_tools(body)
            for i, m in enumerate(messages):
                told = history_message(i, m) if isinstance(m, dict) else None
                if told is not None:
                    prompt.append(told)
                    continue
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                        or not isinstance(m.get("content"), str):
                    raise BadRequest(f"messages[{i}] must be {{'role': 'system'|'user'|'assistant', 'content': "
                                     "a string}}, an assistant message with 'tool_calls' or a 'tool' message "
                                     "(content parts are not supported)", "messages")
                prompt.append({"role": m["role"], "content": m["content"]})
        except ToolError as exc:
            raise BadRequest(str(exc), exc.param) from None
        prompt = with_tools(prompt, tools)
    else:
        tools = None
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise BadRequest(f"'{name}' belongs to /v1/chat/completions", name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        token_ids = (isinstance(prompt, list) and prompt
                     and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt))
        if not token_ids and (not isinstance(prompt, str) or not prompt):
            raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt "
                             "per request)", "prompt")
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise BadRequest("'n' must be 1", "n")
    for name, neutral in UNHONOURED.items():
        value = body.get(name)
        if not any(_same(value, v) for v in neutral):
            raise BadRequest(f"'{name}' is not supported by this server; leave it out (or send "
                             f"{json.dumps(neutral[1])}), got {json.dumps(value)[:80]}", name)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    echo = _echo(body, chat)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", cfg.default_max_tokens, 0 if echo else 1,
                         cfg.max_tokens, integer=True)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise BadRequest(f"'seed' must be a non-negative integer, got {seed!r}", "seed")
    stream, ignore_eos = body.get("stream", False), body.get("ignore_eos", False)
    if not isinstance(stream, bool) or not isinstance(ignore_eos, bool):
        raise BadRequest("'stream' and 'ignore_eos' must be true or false", "stream")
    cache_prompt = body.get("cache_prompt", cfg.prompt_cache)  # as llama-server takes it
    if not isinstance(cache_prompt, bool):
        raise BadRequest("'cache_prompt' must be true or false", "cache_prompt")
    options = body.get("stream_options")
    logprobs = _logprobs_wanted(body, chat)
    bias = _logit_bias(body)
    grammar = _grammar(body)
    if tools is not None:
        if grammar is not None:
            raise BadRequest("tools constrain the answer themselves: send 'tools' or a response format, not both",
                             "tools")
        grammar = tools.grammar
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("'stream_options' is only allowed with \"stream\": true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest("'stream_options' must be an object such as {\"include_usage\": true}", "stream_options")
        include_usage = options.get("include_usage", False)
    gen = GenerationConfig(max_new_tokens=max_tokens,
                           temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                           top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)), seed=seed, stop=stop,
                           ignore_eos=ignore_eos, reuse_prefix=cache_prompt, logprobs=logprobs,
                           prompt_logprobs=logprobs if echo else None,
                           presence_penalty=float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
                           frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0)),
                           logit_bias=bias, grammar=grammar,
                           # a seed makes the answer a function of the seed alone, whatever the
                           # scheduler chose under the server's load at the time
                           sampling="rejection" if seed is None else "coupled")
    return prompt, gen, stream, include_usage, echo, tools


def _echo(body: dict, chat: bool) -> bool:
    """``echo`` (the completions API): the prompt comes back before the answer, and with
    ``logprobs`` its tokens' log-probabilities before the answer's (``max_tokens`` may then be 0:
    the prompt scored, nothing answered). Not streamed."""
    echo = body.get("echo", False)
    if echo is None or echo is False:
        return False
    if echo is not True:
        raise BadRequest(f"'echo' must be true or false, got {json.dumps(echo)[:80]}", "echo")
    if chat:
        raise BadRequest("'echo' belongs to /v1/completions; chat completions do not repeat the messages", "echo")
    if body.get("stream", False) is True:
        raise BadRequest("'echo' is served without streaming: leave out \"stream\" or \"echo\"", "echo")
    return True


def _grammar(body: dict) -> Grammar | None:
    """Structured output: OpenAI's ``response_format`` (``{"type": "text"}``, ``{"type":
    "json_object"}`` for any JSON object, ``{"type": "json_schema", "json_schema": {"name": …,
    "schema": {…}}}``), or llama-server's ``json_schema`` (a schema) or ``grammar`` (GBNF); one
    of them per request. A schema or grammar that does not compile is a 400 naming the error."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise BadRequest(f"send one of {', '.join(repr(k) for k in given)}, not several", given[1])
    if not given:
        return None
    name = given[0]
    value = body[name]
    try:
        if name == "grammar":
            if not isinstance(value, str):
                raise BadRequest("'grammar' must be a GBNF grammar (a string such as 'root ::= \"yes\" | \"no\"')",
                                 name)
            return Grammar.gbnf(value)
        if name == "json_schema":
            if not isinstance(value, dict):
                raise BadRequest("'json_schema' must be a JSON schema (an object)", name)
            return Grammar.json(value)
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar.json()
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise BadRequest("'response_format' json_schema needs {\"json_schema\": {\"name\": ..., "
                                 "\"schema\": {...}}}", name)
            return Grammar.json(schema)
        raise BadRequest("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {json.dumps(value)[:120]}", name)
    except ConfigError as exc:
        raise BadRequest(str(exc), name) from None


MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' "logprobs" bound (OpenAI's legacy API)


def _logprobs_wanted(body: dict, chat: bool) -> int | None:
    """How many likeliest tokens to list beside each new one, or None for no log-probabilities.
    Chat: ``"logprobs": true`` with ``top_logprobs`` 0–20; completions: ``"logprobs"`` 0–5."""
    wanted = body.get("logprobs")
    if chat:
        if wanted not in (None, True, False):
            raise BadRequest(f"'logprobs' must be true or false, got {json.dumps(wanted)[:80]}", "logprobs")
        top = _number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
        if top and wanted is not True:
            raise BadRequest("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
        return top if wanted is True else None
    if body.get("top_logprobs") not in (None, 0):
        raise BadRequest("'top_logprobs' belongs to /v1/chat/completions; here send \"logprobs\": N (0-5)",
                         "top_logprobs")
    if wanted is None or wanted is False:
        return None
    return _number(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS, integer=True)


MAX_LOGIT_BIAS = 1024  # token ids one request may bias


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token ids (as strings, as JSON keys are) to numbers in
    [-100, 100]; the ids are checked against the vocabulary when the request runs."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) to "
                         "numbers in [-100, 100], e.g. {\"50256\": -100}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise BadRequest(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for token {key}",
                             "logit_bias")
        out[int(key)] = float(value)
    if len(out) < len(bias):
        raise BadRequest("'logit_bias' names a token id twice (e.g. \"7\" and \"07\")", "logit_bias")
    return tuple(sorted(out.items()))


def _logprobs_body(entries, chat: bool, decode, offset: int = 0) -> dict:
    """OpenAI's ``logprobs`` object of a choice (or a chunk) for ``entries`` (``TokenLogprob``),
    the tokens' text by ``decode`` (token id → str): chat's ``content`` list, or the completions
    API's parallel lists (``text_offset`` counted from ``offset``, where a chunk's first token
    starts). Each token's text is what it decodes to alone: a token that ends inside a UTF-8
    character decodes to a replacement character, and ``bytes`` are that text's."""
    if chat:
        def item(tid: int, lp: float) -> dict:
            text = decode(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    tokens = [decode(e.token_id) for e in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {decode(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


# --- the worker --------------------------------------------------------------------------------
@dataclass
class Job:
    prompt: Any
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("start"|"piece"|"end"|"error", payload)
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float = 0.0
    timed_out: bool = False
    stream: Any = None  # the pipeline's TextStream while the job runs

    def post(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop closed (the server stopped): nobody is waiting
            self.cancel.set()

    def stop(self) -> None:
        """Cancel from any thread: a queued job is skipped, a running one ends after its round
        (``TextStream.cancel`` is safe from another thread)."""
        self.cancel.set()
        stream = self.stream
        if stream is not None:
            stream.cancel()


# A prompt continues a slot's conversation when it carries at least this share of the slot's kept
# K/V: a next turn carries all of it (up to where the answer's text tokenizes otherwise), another
# conversation only the template's opening.
CONTINUES = 0.5


class Worker:
    """Threads decoding queued jobs, one per pipeline of ``pipes`` (one pipeline: one request at
    a time; the slots of ``Pipeline.batch_slots``: that many at once, batched). With several
    slots a dispatcher hands the jobs out in arrival order, each to the idle slot whose kept K/V
    cover most of its prompt (``Pipeline.reusable``): a conversation's next turn goes back to
    the slot that answered the last one while that slot is free."""

    def __init__(self, pipes: list, cfg: ServeConfig) -> None:
        self.pipes, self.cfg = pipes, cfg
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=cfg.max_queue)
        self.running = 0  # requests being decoded now
        self._count = threading.Lock()
        several = len(pipes) > 1
        self._inbox = [queue.Queue(maxsize=1) for _ in pipes] if several else None
        self._idle = threading.Condition()
        self._free = set(range(len(pipes)))  # slots with no job (several slots only)
        self._used, self._clock = [0] * len(pipes), 0  # when each slot was last handed a job
        self.threads = [threading.Thread(target=self._loop, args=(i, p), name=f"dspark-serve-{i}", daemon=True)
                        for i, p in enumerate(pipes)]
        if several:
            self.threads.append(threading.Thread(target=self._dispatch, name="dspark-serve-dispatch", daemon=True))
        for t in self.threads:
            t.start()

    @property
    def busy(self) -> bool:
        return self.running > 0

    def submit(self, job: Job) -> None:
        job.deadline = time.monotonic() + self.cfg.request_timeout_s
        self.jobs.put_nowait(job)  # queue.Full: the caller answers 429

    def close(self) -> None:
        for _ in self.threads:
            try:
                self.jobs.put_nowait(None)
            except queue.Full:
                break
        for t in self.threads:
            t.join(timeout=30)

    def _dispatch(self) -> None:
        while True:
            with self._idle:
                while not self._free:
                    self._idle.wait()
            job = self.jobs.get()
            if job is None:
                for box in self._inbox:
                    box.put(None)
                return
            with self._idle:
                slot = self._pick(job, sorted(self._free))
                self._free.discard(slot)
            self._inbox[slot].put(job)

    def _pick(self, job: Job, free: list[int]) -> int:
        """The free slot whose kept K/V the job's prompt continues most (at least
        ``CONTINUES`` of them: its conversation's last turn), else the free slot used least
        recently: a prompt that shares only the template's opening with every slot keeps off
        the slots that hold other conversations for as long as it can."""
        self._clock += 1
        chosen = min(free, key=lambda i: self._used[i])
        if job.config.reuse_prefix and len(free) > 1:
            try:
                ids = self.pipes[free[0]].encode_prompt(job.prompt, job.config.special_in_content)
            except DSparkError:  # the slot's own generation answers it
                ids = None
            if ids is not None:
                share = {i: self.pipes[i].reusable(ids) / max(1, self.pipes[i].kept_length) for i in free}
                best = max(free, key=share.__getitem__)
                if share[best] >= CONTINUES:
                    chosen = best
        self._used[chosen] = self._clock
        return chosen

    def _loop(self, index: int, pipe) -> None:
        while True:
            job = (self._inbox[index] if self._inbox is not None else self.jobs).get()
            if job is None:
                return
            try:
                self._serve(pipe, job)
            finally:
                with self._idle:
                    self._free.add(index)
                    self._idle.notify_all()

    def _serve(self, pipe, job: Job) -> None:
        if job.cancel.is_set() or time.monotonic() > job.deadline:  # left (499) or timed out (504) queued
            job.timed_out = job.timed_out or not job.cancel.is_set()
            job.post("error", (504, f"the request waited in the queue past --request-timeout "
                                    f"({self.cfg.request_timeout_s:g} s); retry later") if job.timed_out
                     else (499, "the client closed the request"))
            return
        with self._count:
            self.running += 1
        try:
            self._run(pipe, job)
        except Exception as exc:  # a fault outside the project's errors: answer 500, keep serving
            log.exception("request failed")
            job.post("error", (500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            with self._count:
                self.running -= 1

    def _run(self, pipe, job: Job) -> None:
        try:
            stream = job.stream = pipe.stream(job.prompt, job.config)
        except DSparkError as exc:
            job.post("error", (400, str(exc)))
            return
        if job.cancel.is_set():  # stopped between the check above and now
            stream.cancel()
        job.post("start")
        cfg = job.config
        ends = frozenset() if cfg.ignore_eos or cfg.logprobs is None else pipe.eos_ids | set(cfg.stop_token_ids)
        sent = 0  # log-probabilities posted so far (an end-of-turn token's are not: it has no text)

        def fresh() -> list | None:
            nonlocal sent
            if cfg.logprobs is None:
                return None
            new = stream.logprobs[sent:]
            sent += len(new)
            return [e for e in new if e.token_id not in ends]

        try:
            for piece in stream:
                job.post("piece", (piece, fresh()))
                if time.monotonic() > job.deadline:
                    job.timed_out = True
                    stream.cancel()
                elif job.cancel.is_set():
                    stream.cancel()
        except DSparkError as exc:  # a generation that failed mid-way
            job.post("error", (500, str(exc)))
            return
        finally:
            stream.close()
            job.stream = None
        job.post("end", (stream.result, fresh()))


# --- the app -----------------------------------------------------------------------------------
def build_app(pipe, cfg: ServeConfig, metrics=None):
    """The Starlette application serving ``pipe`` (its worker thread starts now; the app's
    shutdown stops it). ``metrics``: a ``PrometheusMetrics`` observing ``pipe``, or None."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    worker = Worker(pipe.batch_slots(cfg.parallel, verify_slots=cfg.shared_verify) if cfg.parallel > 1 else [pipe],
                    cfg)
    counters = _server_counters(metrics)

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return pipe.tokenizer.decode([token_id], skip_special_tokens=False)

    def fail(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        counters["requests"](str(status))
        return JSONResponse(error_body(message, kind, param), status_code=status)

    def key_refused(request: Request):
        """The 401 answer when an API key is set and the request does not carry it, else None."""
        if cfg.api_key is None or request.headers.get("authorization", "") == f"Bearer {cfg.api_key}":
            return None
        return fail(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error")

    async def read_json(request: Request):
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is {size} bytes; at most {MAX_BODY_BYTES} are accepted", status=413)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise BadRequest(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not JSON ({exc})") from exc

    async def next_event(request: Request, job: Job):
        """The worker's next event, or None when the client went away (the job is stopped). Past
        its deadline the job is stopped and its end (a round later) still awaited."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.stop()
                    return None
                now = time.monotonic()
                if now > job.deadline and not job.timed_out:
                    job.timed_out = True
                    job.stop()
                elif now > job.deadline + STUCK_S:  # no end a long while after the stop: give up waiting
                    return ("error", (504, "the request ran past --request-timeout and did not stop"))

    async def complete(request: Request, chat: bool):
        if (refused := key_refused(request)) is not None:
            return refused
        try:
            body = await read_json(request)
            # in a thread: a large JSON schema or grammar takes a while to compile, and the
            # event loop serves the other requests' streams meanwhile
            prompt, gen, stream, include_usage, echo, tools = await asyncio.to_thread(parse_request, body, chat, cfg)
        except BadRequest as exc:
            return fail(exc.status, str(exc), exc.kind, exc.param)
        job = Job(prompt, gen, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except queue.Full:
            return fail(429, f"the server is busy: {cfg.max_queue} requests are waiting (--max-queue); retry later",
                        "server_busy")
        counters["queued"](worker.jobs.qsize())
        first = await next_event(request, job)
        if first is None:
            return fail(499, "the client closed the request")
        if first[0] == "error":
            status, message = first[1]
            return fail(status, message, "invalid_request_error" if status == 400 else "server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if stream:
            counters["requests"]("200")
            return StreamingResponse(_sse(request, job, rid, created, chat, cfg.model, next_event, include_usage,
                                          token_text if gen.logprobs is not None else None, tools is not None),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, logprobs = "", []
        while True:
            ev = await next_event(request, job)
            if ev is None:
                return fail(499, "the client closed the request")
            kind, payload = ev
            if kind == "piece":
                text += payload[0]
                logprobs += payload[1] or []
            elif kind == "error":
                return fail(payload[0], payload[1], "server_error")
            else:
                result, rest = payload
                logprobs += rest or []
                break
        if job.timed_out:
            return fail(504, f"the request ran past --request-timeout ({cfg.request_timeout_s:g} s); ask for fewer "
                             "max_tokens", "timeout")
        counters["requests"]("200")
        if echo:  # the prompt's tokens first, the first one unscored
            shown = prompt if isinstance(prompt, str) else pipe.tokenizer.decode(prompt, skip_special_tokens=False)
            text = shown + text
            logprobs = [SimpleNamespace(token_id=result.prompt_ids[0], logprob=None, top=None),
                        *(result.prompt_logprobs or ())[1:], *logprobs]
        body = (_logprobs_body(logprobs, chat, token_text) if gen.logprobs is not None else None)
        calls = None
        if tools is not None:
            text, calls = reply(text)
        return JSONResponse(_response(rid, created, chat, cfg.model, text, result, body, calls))

    async def chat_completions(request: Request):
        return await complete(request, True)

    async def completions(request: Request):
        return await complete(request, False)

    async def models(request: Request):
        if (refused := key_refused(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": cfg.model, "object": "model", "created": 0,
                                                         "owned_by": "dspark_edge"}]})

    async def tokenize(request: Request):
        """vLLM's and llama-server's ``/tokenize``: the token ids of a text (``prompt``, or
        ``content`` as llama-server names it) or of chat messages through the template."""
        if (refused := key_refused(request)) is not None:
            return refused
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            text = body.get("prompt", body.get("content"))
            if "messages" in body:
                prompt, *_ = parse_request({"messages": body["messages"]}, True, cfg)
            elif isinstance(text, str) and text:
                prompt = text
            else:
                raise BadRequest("give 'prompt' (or 'content'), a non-empty string, or 'messages'", "prompt")
            ids = await asyncio.to_thread(pipe.encode_prompt, prompt)
        except BadRequest as exc:
            return fail(exc.status, str(exc), exc.kind, exc.param)
        except DSparkError as exc:
            return fail(400, str(exc))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": pipe.target.capacity})

    async def detokenize(request: Request):
        """``/detokenize``: the text of token ids (``prompt`` as vLLM names it, ``content`` as
        llama-server does), special tokens included."""
        if (refused := key_refused(request)) is not None:
            return refused
        try:
            body = await read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            vocab = pipe.manifest.model.vocab_size
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < vocab for t in tokens):
                raise BadRequest(f"'tokens' must be a list of token ids in 0..{vocab - 1}", "tokens")
        except BadRequest as exc:
            return fail(exc.status, str(exc), exc.kind, exc.param)
        text = pipe.tokenizer.decode(tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text, "content": text})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "busy": worker.busy, "running": worker.running,
                             "queued": worker.jobs.qsize()})

    async def prometheus(request: Request):
        if (refused := key_refused(request)) is not None:
            return refused
        if metrics is None:
            return fail(404, "metrics need the prometheus-client package: pip install prometheus-client")
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/metrics", prometheus, methods=["GET"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.worker = worker
    return app


def _server_counters(metrics):
    """Request counts by status and the queue depth, in the metrics' registry (or nothing)."""
    if metrics is None:
        return {"requests": lambda status: None, "queued": lambda n: None}
    import prometheus_client as pc

    kw = {"namespace": "dspark_edge", "registry": metrics.registry}
    requests = pc.Counter("server_requests", "HTTP completion requests answered, by status", ["status"], **kw)
    queued = pc.Gauge("server_queue_depth", "Requests waiting when the last one arrived", **kw)
    return {"requests": lambda status: requests.labels(status=status).inc(), "queued": queued.set}


def _usage(result) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": result.stats.prompt_tokens, "completion_tokens": n,
            "total_tokens": result.stats.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": result.stats.prompt_reused}}


def _response(rid: str, created: int, chat: bool, model: str, text: str | None, result,
              logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
    finish = _finish(result, bool(tool_calls))
    message = {"role": "assistant", "content": text} | ({"tool_calls": tool_calls} if tool_calls else {})
    choice = ({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": _usage(result),
            "dspark": {"stop_reason": result.stop_reason, "tokens_per_s": round(result.stats.tokens_per_s, 2),
                       "draft_n": result.stats.draft_n, "draft_n_accepted": result.stats.draft_n_accepted}}


def _finish(result, called: bool) -> str:
    """OpenAI's finish reason: "tool_calls" for calls the answer completed, "length" for an
    answer cut short (calls included: their arguments are cut too)."""
    reason = FINISH.get(result.stop_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def _tools_chunk(chunk, out: tuple, logprobs: list) -> str:
    """The event of one ``AnswerStream`` output (with the log-probabilities held until it)."""
    if out[0] == "content":
        return chunk(out[1], None, logprobs=logprobs)
    if out[0] == "call":
        calls = [{"index": out[1], "id": call_id(), "type": "function", "function": {"name": out[2], "arguments": ""}}]
    else:
        calls = [{"index": out[1], "function": {"arguments": out[2]}}]
    return chunk(None, None, logprobs=logprobs, calls=calls)


async def _sse(request, job: Job, rid: str, created: int, chat: bool, model: str, next_event,
               include_usage: bool = False, token_text=None, tools: bool = False):
    """Server-sent events of one answer; a client that goes away cancels the job (finally).
    With ``tools`` the answer is JSON read as it comes (``tools.AnswerStream``): a plain answer
    is streamed as its text, tool calls as OpenAI streams them (a call's id and name, then its
    arguments' text in pieces), each as soon as it is known; log-probabilities go with the next
    chunk sent.
    With ``include_usage`` every event carries ``"usage": null`` and a last one, after the
    finish reason, the answer's token counts with no choices (OpenAI's ``stream_options``).
    With ``token_text`` (log-probabilities asked for) each chunk carries those of the tokens
    decoded since the previous chunk (a chunk's text can lag its tokens: text that may start a
    stop string is held back), and the finish chunk those of the rest."""
    kind_name = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> str:
        body = {"id": rid, "object": kind_name, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = None
        return "data: " + json.dumps(body | extra) + "\n\n"

    at = 0  # the completions API's text_offset of the next token

    def chunk(delta: str | None, finish: str | None, first: bool = False, logprobs: list | None = None,
              calls: list | None = None) -> str:
        """One event; ``calls``: the delta's ``tool_calls`` entries as they are sent."""
        nonlocal at
        lp = None
        if token_text is not None and not first:
            lp = _logprobs_body(logprobs or [], chat, token_text, at)
            at += sum(len(token_text(e.token_id)) for e in logprobs or [])
        if chat:
            d = ({"role": "assistant", "content": ""} if first else {}) | ({"content": delta} if delta else {})
            if calls:
                d["tool_calls"] = calls
            return event([{"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish}])
        return event([{"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": lp}])

    try:
        if chat:
            yield chunk(None, None, first=True)
        answer, held_logprobs = AnswerStream(), []  # with tools: the JSON read so far
        while True:
            ev = await next_event(request, job)
            if ev is None:
                return
            kind, payload = ev
            if kind == "piece" and tools:
                held_logprobs += payload[1] or []
                for out in answer.feed(payload[0]):
                    yield _tools_chunk(chunk, out, held_logprobs)
                    held_logprobs = []
            elif kind == "piece":
                yield chunk(payload[0], None, logprobs=payload[1])
            elif kind == "error":
                yield "data: " + json.dumps(error_body(payload[1], "server_error")) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                if job.timed_out:
                    yield "data: " + json.dumps(error_body("the request ran past --request-timeout", "timeout")) + "\n\n"
                else:
                    result, rest = payload
                    if tools:
                        # an answer cut before it said what it is: its raw text, as ``reply`` gives it
                        yield chunk(answer.unread, _finish(result, answer.called),
                                    logprobs=held_logprobs + (rest or []))
                    else:
                        yield chunk(None, FINISH.get(result.stop_reason, "stop"), logprobs=rest)
                    if include_usage:
                        yield event([], usage=_usage(result))
                yield "data: [DONE]\n\n"
                return
    finally:
        job.stop()  # a no-op after the end; stops the decoding when the client left
