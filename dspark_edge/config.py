"""What a caller asks of a generation and what it gets back (frozen, JSON-friendly)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError
from .grammar import Grammar


def check_field_types(obj, error: type[Exception] = ConfigError) -> None:
    """Check (and normalise) every field of the frozen dataclass ``obj`` against its annotation,
    before any range check: a bool field takes True/False only (``"no"`` is refused, not
    truthy), an int field any integer but a bool (numpy integers become int), a float field any
    finite real but a bool, a Literal one of its values, ``X | None`` None as well. The error
    names the field, the value and what it takes. Fields of other types are left to the class."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, fixed, wants = _check(hints[f.name], value)
        if not ok:
            raise error(f"{f.name} must be {wants}, got {value!r} ({type(value).__name__})")
        if fixed is not value:
            object.__setattr__(obj, f.name, fixed)


def _check(hint, value) -> tuple[bool, object, str]:
    """(value fits, the value normalised, what the hint takes in words)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return True, None, ""
        rest = [a for a in args if a is not type(None)]
        ok, fixed, wants = _check(rest[0] if len(rest) == 1 else typing.Union[tuple(rest)], value)
        return ok, fixed, f"{wants} or None"
    if origin is Literal:
        return value in args and isinstance(value, str | int), value, f"one of {list(args)}"
    if hint is bool:
        import numpy as np

        if isinstance(value, bool | np.bool_):
            return True, bool(value), "true or false"
        return False, value, "true or false"
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_":
            return True, int(value), "an integer"
        return False, value, "an integer"
    if hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_":
            value_f = float(value)
            return math.isfinite(value_f), value_f, "a finite number"
        return False, value, "a finite number"
    return True, value, ""

StopReason = Literal["eos", "stop_string", "max_new_tokens", "context_full", "cancelled", "error"]


MAX_TOP_LOGPROBS = 20  # the likeliest tokens a generation lists beside each new one, at most (OpenAI's bound)


@dataclass(frozen=True)
class TokenLogprob:
    """One new token's log-probability under the target's distribution at its position, and the
    likeliest tokens there with theirs (most likely first; ``GenerationConfig.logprobs`` of them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling and stopping. ``temperature == 0`` is greedy (seed-independent).

    top_k = 0 and top_p = 1 disable those filters. ``stop`` strings end the text before the
    match; ``stop_token_ids`` add to the model's own end-of-turn ids (``ignore_eos`` disables
    both, for benchmarks). ``draft_tokens`` fixes the drafts verified per round: the verify
    width ``draft_tokens + 1`` must be one the engine lists. Otherwise a round keeps draft j
    while the survival of the drafts before it, prod(c_1..c_{j-1}) of the drafter's
    confidences, is at least ``min_survival`` (0 keeps every draft). The rule never looks at
    draft j's own confidence, so sampling stays lossless. ``context_policy``:
    "error" rejects a prompt that does not fit the context, "truncate" keeps its tail.
    ``special_in_content``: chat message content is tokenized as text (a special-token string
    in it cannot end or open a turn); True reads such strings as control tokens.

    ``reuse_prefix``: start from the K/V this pipeline kept of its previous generation (its
    prompt and answer) for the longest prefix the new prompt shares with them, and prefill only
    the rest: a chat's next turn prefills its new message, not the whole history. Those K/V
    were computed by passes of other widths than a fresh prefill's, so the logits can differ
    from a fresh generation's in the last bits (as speculative decoding's do from plain
    decoding's); off by default, so the same call gives the same answer whatever ran before.
    A drafter that reads the target's hidden states (DSpark) needs the whole prompt's: it
    prefills from scratch.

    ``sampling`` (temperature > 0): "rejection" (default) verifies drafts by rejection
    sampling; "coupled" draws the token of every answer position with noise seeded by
    (seed, position) and accepts a draft only where it equals that token, so the answer
    depends on the seed alone (identical to plain decoding with that seed, whatever the
    drafter, widths or timing), at a lower acceptance for drafters that sample.

    ``logprobs``: None (default) records none; k >= 0 records, for every new token, its
    log-probability under the target's distribution at its position and the k likeliest tokens
    there (``TokenLogprob``, at most ``MAX_TOP_LOGPROBS``). They are read from the target pass
    that verified the token (the log-softmax of its logits, before temperature and the top-k /
    top-p filters), so they cost no extra pass and do not depend on the drafter.
    ``prompt_logprobs`` records the same for every prompt token after the first, from the
    prefill's logits (``GenerationResult.prompt_logprobs``, None for the first token); the whole
    prompt is then prefilled (``reuse_prefix`` is not applied), and ``max_new_tokens`` may be 0
    to score a text without answering it.

    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2]) lower the logit of each
    token the answer (not the prompt) already holds, by the first once and by the second once per
    occurrence; ``logit_bias`` adds a fixed amount (in [-100, 100]) to the logits of given token
    ids. They change the target's distribution itself, before temperature and filters, and
    verification applies them as plain decoding does, to every position of a pass with the drafts
    before it counted: greedy output stays plain greedy output under them, and sampling follows
    the changed distribution.

    ``grammar`` (``dspark_edge.Grammar``: a JSON schema, regex, Lark or GBNF grammar) constrains
    the answer: at every position the tokens it does not allow are masked out of the target's
    distribution (after penalties and bias), drafts included, so the answer follows the grammar
    and is the one plain decoding gives under it. The grammar ends the answer with the model's
    end-of-turn token once it is complete (also with ``ignore_eos``); ``stop`` strings still
    apply; a ``max_new_tokens`` reached first leaves it incomplete (stop reason
    "max_new_tokens"). Needs llguidance (``pip install 'dspark-edge[structured]'``).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    context_policy: Literal["error", "truncate"] = "error"
    ignore_eos: bool = False  # benchmarks: always decode max_new_tokens
    speculative: bool = True  # False: plain decoding even when the pipeline has a drafter
    draft_tokens: int | None = None  # drafts per round (verify width - 1); None: by min_survival
    min_survival: float = 0.3  # keep draft j while the drafter's survival prod(c_1..c_{j-1}) >= this
    sampling: Literal["rejection", "coupled"] = "rejection"
    special_in_content: bool = False  # True: special-token strings in chat content are control tokens
    reuse_prefix: bool = False  # True: reuse the kept K/V of the prefix shared with the last generation
    logprobs: int | None = None  # None: off; k: each new token's log-probability and the k likeliest
    prompt_logprobs: int | None = None  # None: off; k: the same for every prompt token after the first
    presence_penalty: float = 0.0  # subtracted from the logit of every token the answer holds already
    frequency_penalty: float = 0.0  # subtracted once per time the answer holds the token already
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is taken too
    grammar: Grammar | None = None  # the answer must follow it (structured output)

    def __post_init__(self) -> None:
        import numpy as np

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or not isinstance(self.stop_token_ids, (tuple, list)):
            raise ConfigError(f"stop and stop_token_ids must be lists, got {self.stop!r} and {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(sorted(bias.items()))
        if not isinstance(bias, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in bias):
            raise ConfigError(f"logit_bias must map token ids to numbers, e.g. {{50256: -100}}, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", tuple((int(t) if isinstance(t, np.integer) else t,
                                                       float(b) if isinstance(b, (np.floating, np.integer)) else b)
                                                      for t, b in bias))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) if isinstance(t, np.integer) else t
                                                         for t in self.stop_token_ids))
        check_field_types(self)  # the types (finite numbers, the Literal fields' values); the ranges follow
        if not 0.0 <= self.min_survival <= 1.0:
            raise ConfigError(f"min_survival must be in [0, 1], got {self.min_survival!r}")
        if self.draft_tokens is not None and self.draft_tokens < 0:
            raise ConfigError(f"draft_tokens must be an integer >= 0 or None, got {self.draft_tokens!r}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ConfigError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the likeliest "
                                  f"tokens listed beside each token), got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)!r}")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
                raise ConfigError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ConfigError("logit_bias names a token id twice")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ConfigError(f"grammar must be a dspark_edge.Grammar (Grammar.json(schema), Grammar.regex(...), "
                              f"...) or None, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reshapes_logits(self) -> bool:
        """Whether penalties or a logit bias change the target's distribution."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class GenerationStats:
    """Counts and timings of one generation, named as llama.cpp / vLLM name them.

    ``rounds`` are target passes after the prefill. ``draft_n`` drafted tokens were verified,
    ``draft_n_accepted`` of them kept; ``accept_length_hist[a]`` counts rounds that accepted a
    drafts; ``acceptance_per_position[i]`` is the share of rounds that reached draft i+1 and
    accepted it; ``bonus_tokens`` counts rounds whose every draft was accepted. ``widths``
    counts the verify widths used.
    """

    prompt_tokens: int
    new_tokens: int
    prompt_truncated: int
    prefill_s: float
    decode_s: float
    rounds: int
    widths: dict[str, int] = field(default_factory=dict)
    drafter: str = "none"
    draft_n: int = 0
    draft_n_accepted: int = 0
    accept_length_hist: dict[str, int] = field(default_factory=dict)
    acceptance_per_position: tuple[float, ...] = ()
    bonus_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    drafter_disabled: str | None = None
    modes: dict[str, int] = field(default_factory=dict)  # scheduler rounds per mode (normal/hot/parked/probe)
    prompt_reused: int = 0  # prompt tokens whose K/V came from the previous generation (reuse_prefix)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding; the first token comes from the prefill."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def tokens_per_s_with_prefill(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round (accepted drafts + the target's own token)."""
        return (self.draft_n_accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def draft_correction_rate(self) -> float:
        """Share of rounds with drafts in which the target corrected a draft."""
        with_drafts = sum(v for k, v in self.widths.items() if k != "1")
        return (with_drafts - self.bonus_tokens) / with_drafts if with_drafts else 0.0

    def as_dict(self) -> dict:
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["acceptance_per_position"] = list(self.acceptance_per_position)
        for name in ("total_s", "tokens_per_s", "tokens_per_s_with_prefill", "acceptance_rate",
                     "mean_accepted_length", "draft_correction_rate"):
            out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    stop_reason: StopReason
    stats: GenerationStats
    error: str | None = None
    prompt_ids: tuple[int, ...] = ()  # the prompt as the target read it (after the chat template, any truncation)
    logprobs: tuple[TokenLogprob, ...] | None = None  # with GenerationConfig.logprobs: one per token_ids entry
    # with GenerationConfig.prompt_logprobs: one per prompt_ids entry, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
