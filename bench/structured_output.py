"""Structured output's speed: JSON answers to a schema, plainly and with drafters, as ratios in one process.

    python bench/structured_output.py --engine engines/smollm2-135m [--drafters none,ngram,ngram+self]
        [--precision fp32] [--passes 2] [--max-new-tokens 160]

Each prompt below asks for a JSON record, decoded greedily under the prompt's schema
(``Grammar.json``) plainly (``speculative=False``: one token a pass) and by every drafter
("none": no drafter, only the text the grammar forces drafted), the modes in a rotating order at
every prompt, and once more plainly with no grammar at all (how fast the unconstrained model runs
the same prompt). Prints per mode the median decode rate, the geometric mean of its rate over
plain decoding under the grammar on the same prompt, the drafts verified and accepted, whether every answer
equals plain decoding's under the grammar and parses as JSON, and the milliseconds a token the
grammar's masks took (llguidance's walk, the masks' unpacking and application: timed around
``Constraint`` calls).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np

import dspark_edge
from dspark_edge import Grammar
from dspark_edge.grammar import Constraint

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40}, "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                                             "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60}, "author": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    "genres": {"type": "array", "items": {"enum": ["fiction", "science", "history", "poetry", "fantasy"]},
               "maxItems": 3},
    "summary": {"type": "string", "maxLength": 200}},
    "required": ["title", "author", "year", "genres", "summary"], "additionalProperties": False}
TASK = {"type": "object", "properties": {
    "task": {"type": "string", "maxLength": 60}, "priority": {"enum": ["low", "medium", "high"]},
    "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 5}},
    "required": ["task", "priority", "steps"], "additionalProperties": False}
PROMPTS = [
    ("Describe a fictional person as JSON with name, age, city and hobbies.", PERSON),
    ("Give me a JSON record of a famous novel: title, author, year, genres and a short summary.", BOOK),
    ("Plan how to bake bread as JSON: the task, its priority and the steps.", TASK),
    ("Write a JSON profile of a retired teacher who loves gardening.", PERSON),
    ("Return a JSON object describing a book about the history of Rome.", BOOK),
    ("As JSON, list the steps to change a bicycle tyre, with a priority.", TASK),
]


class GrammarClock:
    """Seconds spent in ``Constraint``'s masks (the pass's and a drafter's), their application and its steps while installed."""

    NAMES = ("masks", "apply", "take", "allowed_after")

    def __init__(self) -> None:
        self.s = 0.0
        self._saved = {name: Constraint.__dict__[name] for name in self.NAMES}

    def _timed(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t
        return timed

    def __enter__(self):
        for name, raw in self._saved.items():
            static = isinstance(raw, staticmethod)
            timed = self._timed(raw.__func__ if static else raw)
            setattr(Constraint, name, staticmethod(timed) if static else timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, raw in self._saved.items():
            setattr(Constraint, name, raw)


class Unconstrained:
    """A drafter as it drafts without a grammar: its requests lose ``allowed`` (the rest of
    the drafter protocol is the wrapped drafter's)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def propose(self, request, rng):
        return self._inner.propose(replace(request, allowed=None), rng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--drafters", default="none,ngram,ngram+self",
                    help="drafter names; NAME/free: the drafter drawing its drafts without the grammar (the "
                         "round still cuts those it refuses), to measure drafting under it")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    args = ap.parse_args()
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if "none" not in drafters:
        drafters.insert(0, "none")
    pipes = {d: dspark_edge.load(args.engine, args.precision, drafter=d.removesuffix("/free")) for d in drafters}
    for d in drafters:
        if d.endswith("/free"):
            pipes[d].drafter = Unconstrained(pipes[d].drafter)
    modes = ["plain"] + drafters + ["unconstrained"]
    constrained = ["plain"] + drafters
    rates = {m: [] for m in modes}
    drafted = dict.fromkeys(modes, 0)
    accepted = dict.fromkeys(modes, 0)
    grammar_s = dict.fromkeys(constrained, 0.0)
    tokens = dict.fromkeys(modes, 0)
    equal, parsed, complete = dict.fromkeys(constrained, 0), 0, 0
    try:
        for d in drafters:  # untimed warm-up (and llguidance's vocabulary, made once)
            pipes[d].generate("Hi", max_new_tokens=4, grammar=Grammar.json(PERSON))
        for _ in range(args.passes):
            for i, (text, schema) in enumerate(PROMPTS):
                msgs = [{"role": "user", "content": text}]
                grammar = Grammar.json(schema)
                order = modes[i % len(modes):] + modes[:i % len(modes)]
                got = {}
                for m in order:
                    pipe = pipes["none" if m in ("plain", "unconstrained") else m]
                    with GrammarClock() as clock:
                        r = pipe.generate(msgs, max_new_tokens=args.max_new_tokens, speculative=m not in
                                          ("plain", "unconstrained"), grammar=None if m == "unconstrained" else grammar)
                    rates[m].append(r.stats.tokens_per_s)
                    drafted[m] += r.stats.draft_n
                    accepted[m] += r.stats.draft_n_accepted
                    tokens[m] += len(r.token_ids)
                    if m != "unconstrained":
                        grammar_s[m] += clock.s
                    got[m] = r
                want = got["plain"]
                complete += want.stop_reason == "eos"
                try:
                    json.loads(want.text)
                    parsed += 1
                except json.JSONDecodeError:
                    pass
                for m in constrained:
                    equal[m] += got[m].token_ids == want.token_ids
    finally:
        for p in pipes.values():
            p.close()
    base = np.array(rates["plain"])
    n = len(base)
    report = {}
    for m in modes:
        v = np.array(rates[m])
        report[m] = {"median_tok_s": round(float(np.median(v)), 1),
                     "vs_plain_under_grammar": round(float(np.exp(np.mean(np.log(v / base)))), 3),
                     "drafted": drafted[m], "accepted": accepted[m]}
        if m != "unconstrained":
            report[m]["equal_to_plain"] = f"{equal[m]}/{n}"
            report[m]["grammar_ms_per_token"] = round(1e3 * grammar_s[m] / max(1, tokens[m]), 3)
    print(json.dumps({"engine": args.engine, "precision": args.precision, "prompts": len(PROMPTS),
                      "passes": args.passes, "max_new_tokens": args.max_new_tokens,
                      "answers_parsed_as_json": f"{parsed}/{n}", "answers_complete": f"{complete}/{n}",
                      "modes": report}, indent=1))


if __name__ == "__main__":
    import sys

    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
