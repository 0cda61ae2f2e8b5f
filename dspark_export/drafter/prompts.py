"""The drafter's training prompts: written for this project, composed from task templates and
topics so that they cover the kinds of requests the runtime serves (code, summaries, questions,
chat, stories, arithmetic). Disjoint from the benchmark prompts (``dspark_edge/data/prompts.jsonl``) (a test checks it).

The answers the drafter learns from are the target's own (``data.py``), so no outside text
is needed; the prompts only steer the target into varied territory.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DISTILL_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "distill_prompts.jsonl"

TOPICS = [
    "volcanoes", "the moon", "honey bees", "rain forests", "the human heart", "electric cars", "chess",
    "the printing press", "coffee", "deserts", "glaciers", "the internet", "vaccines", "solar panels",
    "ancient Rome", "octopuses", "gardening", "recycling", "the piano", "bridges", "earthquakes",
    "sleep", "bread baking", "the Olympic games", "satellites", "rivers", "dinosaurs", "libraries",
    "wind turbines", "the immune system", "trains", "mushrooms", "friendship", "time zones",
    "the stock market", "birds migrating", "recycling plastic", "public speaking", "the ocean tides",
    "mountain climbing", "bicycles", "the alphabet", "clouds", "batteries", "museums", "tea",
    "penguins", "lighthouses", "maps", "robots", "music festivals", "camping", "the brain",
]

TEMPLATES = [
    ("qa", "What is the most important thing to know about {t}?"),
    ("qa", "How does {t} work? Explain it to a curious teenager."),
    ("qa", "Give me three surprising facts about {t}."),
    ("qa", "What is the history of {t} in a few sentences?"),
    ("qa", "Why do people care about {t}?"),
    ("chat", "I want to learn more about {t}. Where should I start?"),
    ("chat", "My friend says {t} is boring. How can I convince them otherwise?"),
    ("chat", "Can you give me some advice related to {t}?"),
    ("story", "Write a short story that involves {t}."),
    ("story", "Write a four-line poem about {t}."),
    ("story", "Describe a day in the life of someone who works with {t}."),
    ("summ", "Write a one-paragraph summary of what everyone should know about {t}."),
    ("summ", "List the key points about {t} as bullet points."),
    ("code", "Write a Python class that stores information about {t} and prints a summary."),
    ("code", "Write a Python function that returns a list of five words related to {t}."),
]

MATH = [
    "What is {a} plus {b}? Show your working.",
    "A box holds {a} apples. How many apples are in {b} boxes? Explain.",
    "What is {a} multiplied by {b}? Explain step by step.",
    "Solve for y: {a}y - {b} = {c}. Show each step.",
    "If a train travels {a} km in {b} hours, what is its average speed?",
    "What is {c} percent of {a}?",
]

CODE = [
    "Write a Python function that reverses a list without using reversed().",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that returns the largest number in a list.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Explain the difference between a list and a tuple in Python.",
    "Explain what a for loop does, with a short Python example.",
    "Write a JavaScript function that adds up an array of numbers.",
    "Write a SQL query that selects all users older than 30 from a table named users.",
    "Explain what recursion is with a small example.",
    "Write a Python function that reads a text file and returns the number of lines.",
    "Write a Python function that sorts a list of words by their length.",
]

SYSTEMS = [None, None, None, "You are a helpful assistant.", "You are a concise assistant that answers briefly."]


def training_prompts(seed: int = 0) -> list[dict]:
    """Every training prompt as {"category", "messages"}, in a fixed shuffled order."""
    rng = random.Random(seed)
    out: list[dict] = []
    for line in DISTILL_PROMPTS.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append({"category": "mixed", "messages": json.loads(line)["messages"]})
    for topic in TOPICS:
        for category, template in TEMPLATES:
            out.append({"category": category, "messages": [{"role": "user", "content": template.format(t=topic)}]})
    for i in range(60):
        a, b, c = rng.randint(2, 90), rng.randint(2, 12), rng.randint(5, 60)
        out.append({"category": "math", "messages": [{"role": "user", "content": MATH[i % len(MATH)].format(a=a, b=b, c=c)}]})
    out += [{"category": "code", "messages": [{"role": "user", "content": c}]} for c in CODE]
    return _shuffled_with_systems(out, rng)


def _shuffled_with_systems(recs: list[dict], rng: random.Random) -> list[dict]:
    """``recs`` shuffled in place, each given one of ``SYSTEMS`` (mostly none) by ``rng``."""
    rng.shuffle(recs)
    for rec in recs:
        system = SYSTEMS[rng.randrange(len(SYSTEMS))]
        if system:
            rec["messages"] = [{"role": "system", "content": system}] + rec["messages"]
    return recs


# Copy-heavy tasks: the request carries a text or a piece of code and the answer reuses it
# (summaries, rewrites, explanations). Drafting pays most where an answer repeats its prompt,
# and the templated prompts above never hand the target a text to work from.
PROSE_TASKS = [
    "Summarise in two sentences: {x}",
    "Give a short summary of this text:\n\n{x}",
    "What is the main point of this paragraph?\n\n{x}",
    "Rewrite this paragraph in simpler words:\n\n{x}",
    "List the key points of this text as bullet points:\n\n{x}",
    "Summarise the following in one sentence:\n\n{x}",
]

CODE_TASKS = [
    "Explain what this code does:\n\n{x}",
    "Explain what this code does and suggest one improvement:\n\n{x}",
    "Add comments to this Python function:\n\n{x}",
    "Write a docstring for this function:\n\n{x}",
    "Rewrite this function with clearer variable names:\n\n{x}",
]


def prose_paragraphs(text: str, lo: int = 250, hi: int = 900) -> list[str]:
    """Plain prose paragraphs of ``lo``–``hi`` characters from README-style text (markdown or
    reStructuredText): headings, lists, tables, code and link-heavy blocks are skipped."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if not lines or any(ln[:1] in "#|*-=>`.:[!<+~^" or ln[:2].isdigit() for ln in lines):
            continue
        para = " ".join(lines)
        if not lo <= len(para) <= hi or "http" in para or "```" in para:
            continue
        plain = sum(c.isalpha() or c in " ,.;:'()-" for c in para) / len(para)
        if plain >= 0.93 and para[-1] in ".!?":
            out.append(para)
    return out


def _parse(source: str):
    import ast

    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def docstring_paragraphs(source: str) -> list[str]:
    """Prose paragraphs of a module's docstrings (the module's, its top-level classes' and
    functions')."""
    import ast

    tree = _parse(source)
    if tree is None:
        return []
    nodes = [tree] + [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    return [p for n in nodes for p in prose_paragraphs(ast.get_docstring(n) or "")]


def code_snippets(source: str, min_lines: int = 5, max_lines: int = 25, max_chars: int = 1200) -> list[str]:
    """Top-level functions of a module's source with ``min_lines``–``max_lines`` lines."""
    import ast

    tree = _parse(source)
    if tree is None:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            seg = ast.get_source_segment(source, node)
            if seg and min_lines <= seg.count("\n") + 1 <= max_lines and len(seg) <= max_chars:
                out.append(seg)
    return out


def copy_prompts(documents, count: int, seed: int = 0) -> list[dict]:
    """``count`` copy-heavy prompts (half prose, half code) over ``documents`` (``text.Document``:
    ``prose:*`` README text, ``code:*`` module source, whose docstrings are prose too), as
    {"category", "messages"} in a fixed order that depends only on the documents and the seed.
    Fewer when the documents hold fewer usable pieces."""
    rng = random.Random(seed + 1)
    prose = [p for d in documents if d.name.startswith("prose:") for p in prose_paragraphs(d.text)]
    prose += [p for d in documents if d.name.startswith("code:") for p in docstring_paragraphs(d.text)]
    code = [c for d in documents if d.name.startswith("code:") for c in code_snippets(d.text)]
    rng.shuffle(prose)
    rng.shuffle(code)
    n_code = min(len(code), count // 2)
    n_prose = min(len(prose), count - n_code)
    recs = [{"category": "summ", "messages": [{"role": "user", "content": PROSE_TASKS[i % len(PROSE_TASKS)].format(x=p)}]}
            for i, p in enumerate(prose[:n_prose])]
    recs += [{"category": "code", "messages": [{"role": "user", "content": CODE_TASKS[i % len(CODE_TASKS)].format(x=c)}]}
             for i, c in enumerate(code[:n_code])]
    rng.shuffle(recs)
    return recs


# Task prompts (``python -m export data --tasks N``): the six kinds of request above drawn from
# larger combinatorial families, so that a campaign can add thousands of them, and passage
# tasks over the target's own earlier answers (summaries, rewrites, questions about a given
# text: an answer that reuses its prompt, the case where drafting pays most and where the
# package documents run out after a few hundred paragraphs).
TASK_TOPICS = [
    "a school garden", "a city bus line", "a family bakery", "a small museum", "a mountain village",
    "a football club", "a recycling centre", "a night market", "a science fair", "a book club",
    "a summer camp", "a fishing boat", "a hospital ward", "a train station", "a public library",
    "a coffee shop", "a music school", "an apple orchard", "a space station", "a zoo keeper",
    "a weather station", "a bicycle repair shop", "a chess tournament", "a village festival",
    "a river cleanup", "a pottery class", "a farmers' market", "a mobile app launch", "a bridge repair",
    "a neighbourhood park", "a software team", "a power outage", "a school trip", "a new restaurant",
    "a charity run", "a snowstorm", "a lost dog", "a birthday party", "a job interview",
    "a flooded street", "a moving day", "a camping trip", "a broken laptop", "a garden pond",
    "a language course", "a local election", "a cooking contest", "a hiking trail", "a rooftop farm",
    "a street musician", "a bee farm", "a solar-powered house", "a robot vacuum", "a carpool plan",
    "a home budget", "a new puppy", "a spelling bee", "a board game night", "a city marathon",
    "a lighthouse restoration", "an old clock", "a school newspaper", "a dentist visit", "a weekend market",
    "a science museum", "a winter holiday", "a train delay", "a kite festival", "a bird sanctuary",
    "a community fridge", "a fire drill", "a town hall meeting", "a water shortage", "a new bridge",
]

TASK_TEMPLATES = [
    ("qa", "What should someone know before visiting {t}?"),
    ("qa", "What problems can come up with {t}, and how are they usually solved?"),
    ("qa", "Explain how {t} usually works, in simple terms."),
    ("qa", "Why might {t} matter to the people who live nearby?"),
    ("chat", "I've been asked to help with {t}. What should I do first?"),
    ("chat", "Can you give me three tips for dealing with {t}?"),
    ("chat", "My neighbour keeps talking about {t}. What questions could I ask them?"),
    ("chat", "Help me plan a short message to my team about {t}."),
    ("story", "Write a short story set around {t}."),
    ("story", "Tell me a children's story about {t}."),
    ("story", "Write a short poem inspired by {t}."),
    ("story", "Write a diary entry from someone involved in {t}."),
    ("summ", "Write a short news report about {t}."),
    ("summ", "Write a brief announcement about {t} for a community newsletter."),
    ("summ", "List five facts someone might write about {t}."),
]

TASK_MATH = [
    "A bag holds {a} marbles and {b} more are added each day. How many are there after {c} days? Show your steps.",
    "Tickets cost ${b} each. How much do {a} tickets cost? Explain your working.",
    "A recipe needs {b} eggs for {c} people. How many eggs are needed for {a} people? Show your steps.",
    "Solve for x: {b}x + {c} = {a}. Explain each step.",
    "A car uses {b} litres of fuel per 100 km. How much fuel does it need for {a}0 km?",
    "What is {a} divided by {b}? Give the answer with the remainder and explain.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "{a} students share {c} pizzas equally, each cut into {b} slices. How many slices does each student get?",
    "A shirt costs ${a} and is {c} percent off. What is the sale price? Show your steps.",
    "Tom reads {b} pages a day. How many days does he need for a book of {a}0 pages?",
]

TASK_CODE_ACTIONS = [
    "counts how many times each word appears in", "finds the longest word in", "returns the average of",
    "removes every even number from", "checks whether all items are unique in", "returns the second largest value in",
    "splits into chunks of three", "reverses every word of", "returns only the positive numbers from",
    "capitalises the first letter of every word in",
]
TASK_CODE_THINGS = ["a list of numbers", "a sentence", "a list of strings", "a text file's lines"]
TASK_CODE_LANGS = ["Python", "JavaScript"]

PASSAGE_TASKS = PROSE_TASKS + [
    "Give a short summary of this note: {x}",
    "Summarise this in three bullet points:\n\n{x}",
    "Rewrite this as a short email to a colleague:\n\n{x}",
    "What are the two most important ideas in this text?\n\n{x}",
    "Explain this paragraph to a ten-year-old:\n\n{x}",
    "Write a title and a one-sentence summary for this text:\n\n{x}",
]


# The first words of self-written user messages (``python -m export data --openers``): the target
# writes the rest of the message after one of these, so its messages spread over the kinds of
# request people make of a chat model (stories, questions, explanations, advice, summaries and
# rewrites of a text it writes in, arithmetic, code) instead of the open "help me with X" that
# unseeded self-written messages mostly are. Generic openings only: a message that comes out near
# a benchmark prompt is dropped by the data engine's filter.
MESSAGE_OPENERS = (
    "Write a short story about", "Tell me a story about", "Write a poem about", "Write a story for children about",
    "Describe", "Why do", "Why is", "How does", "How do", "What causes", "What is the difference between",
    "What is", "Explain", "Can you explain", "What are the benefits of", "Is it true that",
    "Hi!", "Hello! I", "I feel", "Can you recommend", "Any tips for", "I want to", "What should I",
    "Summarise this:", "Summarize the following text:", "Give a short summary of this:", "Rewrite this more simply:",
    "Translate into plain English:", "A shop sells", "If a train", "Solve", "How many", "Calculate",
    "Write a Python function that", "Write a function in JavaScript that", "What does this code do?",
    "Fix the bug in this code:", "Write an email to", "Make a list of", "Compare",
)


def answer_passages(texts, lo: int = 200, hi: int = 800) -> list[str]:
    """The first plain-prose paragraph of ``lo``–``hi`` characters of each text (the target's
    earlier answers), at most one per text, in the texts' order."""
    return [paras[0] for paras in (prose_paragraphs(text, lo, hi) for text in texts) if paras]


def task_prompts(count: int, seed: int = 0, passages: list[str] = ()) -> list[dict]:
    """``count`` task prompts as {"category", "messages"} in a fixed order that depends only on
    ``count``, ``seed`` and ``passages``: two fifths passage tasks over ``passages`` (while they
    last); of the rest, four fifths questions, chat, stories, short texts on ``TASK_TOPICS`` and
    small coding tasks (while they last), and arithmetic word problems with drawn numbers for
    the remainder. No prompt repeats."""
    rng = random.Random(seed + 2)
    family = [(c, t.format(t=topic)) for topic in TASK_TOPICS for c, t in TASK_TEMPLATES]
    family += [("code", f"Write a {lang} function that {act} {thing}.")
               for act in TASK_CODE_ACTIONS for thing in TASK_CODE_THINGS for lang in TASK_CODE_LANGS]
    rng.shuffle(family)
    order = list(passages)
    rng.shuffle(order)
    n_pass = min(len(order), (2 * count) // 5)
    picked = family[:min(len(family), (4 * (count - n_pass)) // 5)]
    seen = {text for _, text in picked}
    tries = 0
    while len(picked) < count - n_pass and tries < 50 * count:
        tries += 1
        a, b, c = rng.randint(3, 95), rng.randint(2, 12), rng.randint(2, 40)
        text = TASK_MATH[rng.randrange(len(TASK_MATH))].format(a=a, b=b, c=c)
        if text not in seen:
            seen.add(text)
            picked.append(("math", text))
    recs = [{"category": "summ", "messages": [{"role": "user", "content": PASSAGE_TASKS[i % len(PASSAGE_TASKS)].format(x=p)}]}
            for i, p in enumerate(order[:n_pass])]
    recs += [{"category": c, "messages": [{"role": "user", "content": text}]} for c, text in picked]
    return _shuffled_with_systems(recs, rng)
