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
    rng.shuffle(out)
    for rec in out:
        system = SYSTEMS[rng.randrange(len(SYSTEMS))]
        if system:
            rec["messages"] = [{"role": "system", "content": system}] + rec["messages"]
    return out


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
