"""RULER-style synthetic long-context tasks: contexts as token ids, their JSONL form, RULER's scoring.

Six tasks modelled on NVIDIA RULER's synthetic set (our own code, the prompt wording follows RULER's):

- ``niah_single``: one statement "One of the special magic numbers for {key} is: {value}." in a
  haystack; asked for the value.
- ``niah_multikey``: ``keys`` such statements with different keys; each question asks one key
  (the others are distractors).
- ``niah_multivalue``: one key stated ``values`` times with different values; asked for all of them.
- ``niah_multiquery``: ``keys`` statements; each question asks ``queries`` keys at once.
- ``vt`` (variable tracking): chains "VAR ABCDE = 12345." "VAR FGHIJ = VAR ABCDE." ... of ``hops``
  hops; asked which variables hold the value (answers: every variable of the chain).
- ``cwe`` (common-word extraction): a numbered word list in which ``common`` words appear
  ``common_freq`` times and the others ``uncommon_freq`` times; asked for the common words.

Haystacks: ``noise`` (RULER's repeated sentences "The grass is green. The sky is blue. ...") or a
natural text of :mod:`.haystack` (``pydoc``: CPython's reference prose; ``stdlib``; a file). ``cwe``
has no haystack (its word list is the context); its contexts are labelled ``wordlist``.

A context is split as NVIDIA kvpress splits RULER for query-agnostic compression: the *context*
(instruction + haystack with the statements) comes first and can be prefilled and compressed before
any question exists; each *question* (question text + the answer prefix) is appended after it.
With a chat format the context opens the user turn and each question closes it::

    context_ids  = [BOS] user_prefix instruction body "\\n"
    question_ids = question turn_end answer_prefix      (turn_end "\\n" without a chat format)

``length`` is the total budget: ``len(context_ids) + len(question_ids) + max_new_tokens <= length``
for every question (RULER's ``max_seq_length``), filled with whole haystack sentences.

Scoring is RULER's: an output is post-processed (stripped, control characters made newlines), and a
question scores the share of its answers that occur in it, case-insensitively (``string_match_all``;
``string_match_part`` takes the best single answer instead). A task's score is the mean over its
questions x 100, a suite's the mean of its task scores. :func:`score` is importable so that another
runner scores outputs exactly as kvpolicy does.

JSONL (:func:`write_jsonl` / :func:`read_jsonl`), one line per context::

    {"id": "niah_multikey-pydoc-4096-0", "task": "niah_multikey", "length": 4096, "haystack": "pydoc",
     "model": "gemma3-270m", "chat": "none", "metric": "all", "seed": 0,
     "context_ids": [2, 9195, ...],                       # the context, BOS included (prefill these)
     "spans": [[812, 829], ...],                          # where each statement sits in context_ids
     "stop_ids": [1],                                     # end-of-sequence ids (stop decoding there)
     "questions": [{"question": "What is the special magic number for ...?",
                    "question_ids": [...],                # fed after the context, positions continuing
                    "answers": ["4817206"],               # scored with score(output, answers, metric)
                    "max_new_tokens": 16,                 # greedy tokens at most
                    "full_prompt_ids": [...]}]}           # context_ids + question_ids (question in prompt)

Token ids are built piece by piece (each sentence and statement encoded on its own), so they are the
prompt; a peer runner should feed these ids, never re-encode the text. This module imports no mlx.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
import string
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ...integration.token_ids import check_token_ids
from .cli_options import MAX_LENGTH
from .haystack import haystack_text
from .tokens import bos_ids, encode

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
NOISE = "noise"
WORDLIST = "wordlist"
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lucky",
    "mellow",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rusty",
    "silent",
    "tidy",
    "upbeat",
    "vivid",
    "wooden",
    "young",
    "zesty",
    "bitter",
    "crisp",
    "daring",
    "fierce",
    "golden",
    "hasty",
    "ivory",
    "jagged",
    "lively",
    "misty",
    "narrow",
    "orange",
    "plain",
    "rapid",
    "sharp",
    "tender",
    "velvet",
    "wild",
    "azure",
    "bold",
    "clever",
    "dim",
    "frosty",
)
NOUNS = (
    "anchor",
    "badger",
    "candle",
    "dragon",
    "engine",
    "falcon",
    "garden",
    "hammer",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "otter",
    "pillow",
    "quilt",
    "rocket",
    "saddle",
    "tunnel",
    "umbrella",
    "valley",
    "walrus",
    "yacht",
    "zebra",
    "basket",
    "castle",
    "desert",
    "feather",
    "glacier",
    "harbor",
    "igloo",
    "jungle",
    "kitten",
    "lantern",
    "meadow",
    "nugget",
    "orchard",
    "parrot",
    "quarry",
    "ribbon",
    "spider",
    "teapot",
    "violin",
    "wagon",
    "button",
    "cactus",
    "donkey",
)
VERBS = (
    "argue",
    "bake",
    "carry",
    "dance",
    "enter",
    "float",
    "greet",
    "hurry",
    "invite",
    "juggle",
    "knock",
    "laugh",
    "march",
    "nod",
    "open",
    "paint",
    "quit",
    "relax",
    "smile",
    "travel",
    "unite",
    "visit",
    "wander",
    "yawn",
    "borrow",
    "climb",
    "drift",
    "explain",
    "follow",
    "gather",
    "hover",
    "improve",
    "jump",
    "kneel",
    "listen",
    "mend",
    "notice",
    "offer",
    "polish",
    "rescue",
    "shiver",
    "tumble",
    "vanish",
    "whisper",
)
#: the common-word task draws from these (distinct, lower-case, one to three tokens each)
CWE_WORDS = tuple(dict.fromkeys(ADJECTIVES + NOUNS + VERBS))


# ----------------------------------------------------------------------------- task parameters
@dataclasses.dataclass(frozen=True)
class TaskParams:
    """The knobs of one task (RULER's complexity settings; see :data:`PRESETS`)."""

    keys: int = 1  #: statements with distinct keys (niah_*)
    values: int = 1  #: values stated for the asked key (niah_multivalue)
    queries: int = 1  #: keys asked in one question (niah_multiquery)
    questions: int = 1  #: questions per context (each about a different key or chain)
    digits: int = 7  #: digits of each value
    hops: int = 4  #: vt: assignments after the first in each chain
    chains: int = 1  #: vt: chains in the context
    common: int = 10  #: cwe: words to find
    common_freq: int = 30  #: cwe: occurrences of each common word
    uncommon_freq: int = 3  #: cwe: occurrences of each other word (at least)
    few_shot: bool = True  #: vt, cwe: a small solved example before the context (as RULER)
    statement: str = "One of the special magic numbers for {key} is: {value}."  #: niah statement
    margin: int = 8  #: max_new_tokens = tokens of the answers + margin
    answer: str = "ruler"  #: niah answer prefix: "ruler" (RULER's) or "echo" (the statement's words)
    chain: str = "ruler"  #: vt statements: "ruler" ("VAR B = VAR A.") or "forward" ("VAR A is assigned to VAR B.")
    #: where the statements go: None = seeded random points; d in [0, 1] = every statement after
    #: round(d * U) of the U haystack units (0: first thing in the haystack, 1: last), in order
    depth: Optional[float] = None

    def __post_init__(self):
        for name in (
            "keys",
            "values",
            "queries",
            "questions",
            "digits",
            "chains",
            "common",
            "common_freq",
            "uncommon_freq",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TaskParams.{name}: must be an integer >= 1 (got {v!r})")
        if isinstance(self.hops, bool) or not isinstance(self.hops, int) or self.hops < 0:
            raise ValueError(f"TaskParams.hops: must be an integer >= 0 (got {self.hops!r})")
        if not 1 <= self.digits <= 18:
            raise ValueError(f"TaskParams.digits: must be in 1..18 (got {self.digits})")
        if self.chain not in ("ruler", "forward"):
            raise ValueError(f"TaskParams.chain: must be 'ruler' or 'forward' (got {self.chain!r})")
        if self.answer not in ("ruler", "echo"):
            raise ValueError(f"TaskParams.answer: must be 'ruler' or 'echo' (got {self.answer!r})")
        if self.depth is not None and (
            isinstance(self.depth, bool) or not isinstance(self.depth, (int, float)) or not 0 <= self.depth <= 1
        ):
            raise ValueError(f"TaskParams.depth: must be None or a number in [0, 1] (got {self.depth!r})")
        if "{key}" not in self.statement or "{value}" not in self.statement:
            raise ValueError(f"TaskParams.statement: needs {{key}} and {{value}} (got {self.statement!r})")


#: ``ruler``: RULER's own complexity (4 keys, 4 values, 4 queries, 7 digits, 4 hops, 10 common words) and
#: answer prefixes. ``calibrated``: what a 135M-270M model does with the full cache at 4k tokens (measured,
#: docs/results/long-context.md): the answer prefix repeats the statement's words up to the value ("echo": a small
#: model copies what follows a match), forward chains for vt, 3 common words; :data:`MODEL_PRESETS` has
#: the per-model exceptions.
PRESETS: Dict[str, Dict[str, TaskParams]] = {
    "ruler": {
        "niah_single": TaskParams(),
        "niah_multikey": TaskParams(keys=4, questions=4),
        "niah_multivalue": TaskParams(values=4),
        "niah_multiquery": TaskParams(keys=4, queries=4),
        "vt": TaskParams(hops=4, chains=1, digits=5),
        "cwe": TaskParams(common=10, common_freq=30, uncommon_freq=3),
    },
    "calibrated": {
        "niah_single": TaskParams(answer="echo"),
        "niah_multikey": TaskParams(keys=4, questions=2, answer="echo"),
        "niah_multivalue": TaskParams(values=2, answer="echo"),
        "niah_multiquery": TaskParams(keys=4, queries=2, questions=2, answer="echo"),
        "vt": TaskParams(hops=2, chains=1, digits=5, few_shot=False, chain="forward"),
        "cwe": TaskParams(common=3, common_freq=30, uncommon_freq=1, few_shot=False),
    },
}
#: per-model exceptions to ``calibrated`` (keyed by the start of the model directory's name): SmolLM2-Instruct
#: lists several values after RULER's plural answer prefix, Gemma 3 270M (a base model) does not
MODEL_PRESETS: Dict[str, Dict[str, TaskParams]] = {
    "smollm2": {"niah_multivalue": TaskParams(values=4)},
}


def preset_params(preset: str, task: str, model: str = "") -> TaskParams:
    """The parameters of ``task`` in ``preset`` for ``model`` (a model directory name, e.g. smollm2-135m-float32)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)} (got {preset!r})")
    if preset == "calibrated":
        for family, tasks in MODEL_PRESETS.items():
            if model.lower().startswith(family) and task in tasks:
                return tasks[task]
    return PRESETS[preset][task]


DEFAULT_PRESET = "calibrated"


# ----------------------------------------------------------------------------- chat formats
@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How a context opens and a question closes a user turn (``none``: plain text, kvpress's rule)."""

    user_prefix: str = ""
    turn_end: str = "\n"
    stop: Tuple[str, ...] = ()  #: strings of extra stop tokens (end of turn)


CHATS = {
    "none": ChatFormat(),
    "chatml": ChatFormat("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", ("<|im_end|>",)),
    "gemma": ChatFormat("<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n", ("<end_of_turn>",)),
}


# ----------------------------------------------------------------------------- contexts
@dataclasses.dataclass
class Question:
    """One question about a context: its ids (fed after the context), answers and decode budget."""

    question: str
    question_ids: List[int]
    answers: List[str]
    max_new_tokens: int


@dataclasses.dataclass
class Context:
    """One prompt context and the questions asked about it (see the module docstring)."""

    id: str
    task: str
    length: int
    haystack: str
    model: str
    chat: str
    seed: int
    metric: str
    context_ids: List[int]
    questions: List[Question]
    spans: List[Tuple[int, int]]
    stop_ids: List[int]

    def full_prompt_ids(self, i: int) -> List[int]:
        """The question-in-prompt protocol's prompt for question ``i``: context then question."""
        return self.context_ids + self.questions[i].question_ids

    def total_tokens(self, i: int) -> int:
        q = self.questions[i]
        return len(self.context_ids) + len(q.question_ids) + q.max_new_tokens


def stop_ids(tokenizer, chat: str = "none") -> List[int]:
    """End-of-sequence ids, plus the chat format's end-of-turn token where it is one token."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    for s in CHATS[chat].stop:
        enc = encode(tokenizer, s)
        if len(enc) == 1:
            ids.add(enc[0])
    return sorted(ids)


@functools.lru_cache(maxsize=8)
def _sentences(source: str) -> Tuple[str, ...]:
    """The sentences of a natural haystack, whitespace collapsed (as RULER collapses its essays)."""
    text = re.sub(r"\s+", " ", haystack_text(source))
    parts = re.split(r"(?<=[.!?])\s+", text)
    return tuple(p for p in parts if 2 < len(p) <= 600)


def _haystack_units(tokenizer, haystack: str, rng: random.Random, budget: int) -> List[List[int]]:
    """Whole sentences (each " " + sentence, encoded alone) of ``haystack`` totalling <= ``budget`` tokens."""
    if haystack == NOISE:
        cycle = [encode(tokenizer, " " + s) for s in NOISE_SENTENCES]
        start = 0
    else:
        sents = _sentences(haystack)
        if not sents:
            raise ValueError(f"haystack {haystack!r}: no sentences in its text")
        start = rng.randrange(len(sents))
        cycle = None
    units: List[List[int]] = []
    total, i = 0, start
    while True:
        if cycle is not None:
            u = cycle[i % len(cycle)]
        else:
            u = encode(tokenizer, " " + sents[i % len(sents)])
        if total + len(u) > budget:
            return units
        units.append(u)
        total += len(u)
        i += 1
        if cycle is None and i - start > 10 * len(sents):  # a text whose sentences are all too long
            return units


def _number(rng: random.Random, digits: int, used: set) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits)) if digits > 1 else str(rng.randrange(10))
        if v not in used:
            used.add(v)
            return v


def _keys(rng: random.Random, n: int) -> List[str]:
    """``n`` adjective-noun keys, no adjective or noun shared between two of them."""
    if n > min(len(ADJECTIVES), len(NOUNS)):
        raise ValueError(f"at most {min(len(ADJECTIVES), len(NOUNS))} keys per context (got {n})")
    return [f"{a}-{b}" for a, b in zip(rng.sample(ADJECTIVES, n), rng.sample(NOUNS, n))]


def _join(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]


def _niah_prompts(p: TaskParams, task: str):
    """(instruction, question builder) of the niah tasks; the builder maps the asked keys to
    (question, answer prefix). ``answer="ruler"``: RULER's answer prefix ("The special magic number for
    {query} mentioned in the provided text is"); ``"echo"``: the statement's own words up to the value,
    for the first asked key ("One of the special magic numbers for {key} is:")."""
    many = task in ("niah_multivalue", "niah_multiquery") and (p.values * p.queries > 1)
    noun = "numbers" if many else "number"
    head = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n"
    )

    def question(keys: Sequence[str]) -> Tuple[str, str]:
        query = _join(keys)
        if many:
            q = f"What are all the special magic {noun} for {query} mentioned in the provided text?"
            prefix = f"The special magic {noun} for {query} mentioned in the provided text are"
        else:
            q = f"What is the special magic {noun} for {query} mentioned in the provided text?"
            prefix = f"The special magic {noun} for {query} mentioned in the provided text is"
        if p.answer == "echo":
            prefix = p.statement.split("{value}")[0].format(key=keys[0]).rstrip()
        return q, prefix

    return head, question


def _layout(
    rng: random.Random, n_units: int, groups: List[List[List[int]]], depth: Optional[float] = None
) -> List[Tuple[int, List[int]]]:
    """Insertion points for statement groups: each group's statements in order, at distinct sorted points
    (``depth`` given: every statement at point ``round(depth * n_units)``, in order)."""
    placed = []
    for group in groups:
        if depth is not None:
            placed.extend((round(depth * n_units), stmt) for stmt in group)
            continue
        points = (
            sorted(rng.sample(range(n_units + 1), len(group))) if n_units + 1 >= len(group) else [n_units] * len(group)
        )
        placed.extend(zip(points, group))
    placed.sort(key=lambda x: x[0])  # stable: a chain's statements keep their order at equal points
    return placed


def build_context(
    tokenizer,
    task: str,
    length: int,
    haystack: str = "pydoc",
    seed: int = 0,
    *,
    model: str = "",
    chat: str = "none",
    params: Optional[TaskParams] = None,
    preset: str = DEFAULT_PRESET,
) -> Context:
    """The context and questions of one (task, length, haystack, seed); deterministic.

    ``params`` overrides the preset's parameters of ``task``. Raises ValueError for an unknown task,
    chat format or preset, or a length too short for the task's fixed parts.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)} (got {task!r})")
    if chat not in CHATS:
        raise ValueError(f"chat must be one of {', '.join(CHATS)} (got {chat!r})")
    if isinstance(length, bool) or not isinstance(length, int) or length < 64:
        raise ValueError(f"length must be an integer >= 64 tokens (got {length!r})")
    p = params or preset_params(preset, task, model)
    if task == "cwe":
        haystack = WORDLIST
    rng = random.Random(f"ruler:{task}:{haystack}:{length}:{seed}")
    fmt = CHATS[chat]
    enc = functools.partial(encode, tokenizer)
    head_ids: List[int] = bos_ids(tokenizer) + enc(fmt.user_prefix)
    groups: List[List[List[int]]] = []  # statement token ids, per group kept in order
    qa: List[Tuple[str, str, List[str]]] = []  # (question, answer prefix, answers)
    metric = "all"

    if task.startswith("niah"):
        head, question = _niah_prompts(p, task)
        n_keys = max(
            p.keys,
            p.queries * (p.questions if task == "niah_multiquery" else 1),
            p.questions if task == "niah_multikey" else 1,
        )
        keys = _keys(rng, n_keys)
        used: set = set()
        n_vals = p.values if task == "niah_multivalue" else 1
        values = {k: [_number(rng, p.digits, used) for _ in range(n_vals)] for k in keys}
        stmts = [p.statement.format(key=k, value=v) for k in keys for v in values[k]]
        rng.shuffle(stmts)
        groups = [[enc(" " + s)] for s in stmts]
        if task == "niah_multiquery":
            asked = rng.sample(keys, p.queries * p.questions)
            for j in range(p.questions):
                ks = asked[j * p.queries : (j + 1) * p.queries]
                qa.append((*question(ks), [v for k in ks for v in values[k]], _said(p, ks, values)))
        else:
            n_q = p.questions if task == "niah_multikey" else 1
            for k in rng.sample(keys, min(n_q, len(keys))):
                qa.append((*question([k]), values[k], _said(p, [k], values)))
        head_ids += enc(head)
    elif task == "vt":
        head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        if p.few_shot:
            head = _vt_example(random.Random(f"vt-example:{seed}"), p) + "\n\n" + head
        head_ids += enc(head)
        names = _var_names(rng, p.chains * (p.hops + 1))
        used = set()
        for c in range(p.chains):
            chain = names[c * (p.hops + 1) : (c + 1) * (p.hops + 1)]
            value = _number(rng, p.digits, used)
            lines = _chain_lines(p, chain, value)
            groups.append([enc(" " + s) for s in lines])
            question = f"Question: Find all variables that are assigned the value {value} in the text above."
            if p.chain == "forward":  # the answer retraces the statements: each hop copies what follows its match
                prefix = f"Answer: The value {value} is assigned to VAR"
                said = chain[0] + ". " + " ".join(lines[1:])
            else:
                prefix = (
                    f"Answer: According to the chain(s) of variable assignment in the text above, {p.hops + 1} "
                    f"variables are assigned the value {value}, they are:"
                )
                said = " ".join(chain)
            qa.append((question, prefix, chain, said))
        order = list(range(p.chains))
        rng.shuffle(order)
        qa = [qa[i] for i in order[: p.questions]]
    else:  # cwe
        return _build_cwe(tokenizer, length, seed, p, model, chat, head_ids)

    questions = _questions(tokenizer, fmt, qa, p.margin)
    fixed = len(head_ids) + len(enc("\n")) + max(len(q.question_ids) + q.max_new_tokens for q in questions)
    fixed += sum(len(s) for g in groups for s in g)
    if fixed >= length:
        raise ValueError(f"{task}: length {length} leaves no room for a haystack (fixed parts take {fixed} tokens)")
    units = _haystack_units(tokenizer, haystack, rng, length - fixed)
    placed = _layout(rng, len(units), groups, p.depth)
    ids = list(head_ids)
    spans: List[Tuple[int, int]] = []
    prev = 0
    for point, stmt in placed:
        for u in units[prev:point]:
            ids += u
        prev = point
        spans.append((len(ids), len(ids) + len(stmt)))
        ids += stmt
    for u in units[prev:]:
        ids += u
    ids += enc("\n")
    ctx = Context(
        f"{task}-{haystack}-{length}-{seed}",
        task,
        length,
        haystack,
        model,
        chat,
        seed,
        metric,
        ids,
        questions,
        spans,
        stop_ids(tokenizer, chat),
    )
    assert all(ctx.total_tokens(i) <= length for i in range(len(questions)))
    return ctx


def _said(p: TaskParams, keys: Sequence[str], values: Dict[str, List[str]]) -> str:
    """The text a right answer takes, which sizes ``max_new_tokens``: the values, comma-separated; with the
    ``echo`` prefix and several values, the first value and then each further one in its statement's words."""
    vals = [(k, v) for k in keys for v in values[k]]
    if p.answer != "echo" or len(vals) == 1:
        return ", ".join(v for _, v in vals)
    return vals[0][1] + ". " + " ".join(p.statement.format(key=k, value=v) for k, v in vals[1:])


def _questions(tokenizer, fmt: ChatFormat, qa, margin: int) -> List[Question]:
    """``qa``: (question, answer prefix, answers, the text of a right answer) per question."""
    out = []
    for question, prefix, answers, said in qa:
        ids = encode(tokenizer, question + fmt.turn_end + prefix)
        n = len(encode(tokenizer, " " + said)) + margin
        out.append(Question(question, ids, list(answers), n))
    return out


def _var_names(rng: random.Random, n: int, k: int = 5) -> List[str]:
    names: List[str] = []
    while len(names) < n:
        v = "".join(rng.choices(string.ascii_uppercase, k=k))
        if v not in names:
            names.append(v)
    return names


def _chain_lines(p: TaskParams, chain: Sequence[str], value: str) -> List[str]:
    """One chain's statements: RULER's "VAR B = VAR A." or, ``chain="forward"``, "VAR A is assigned to VAR B."."""
    if p.chain == "forward":
        return [f"The value {value} is assigned to VAR {chain[0]}."] + [
            f"VAR {chain[j]} is assigned to VAR {chain[j + 1]}." for j in range(len(chain) - 1)
        ]
    return [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[j + 1]} = VAR {chain[j]}." for j in range(len(chain) - 1)]


def _vt_example(rng: random.Random, p: TaskParams) -> str:
    """A short solved variable-tracking example (RULER puts one before the task)."""
    names = _var_names(rng, p.hops + 1, k=3)
    value = str(rng.randrange(10 ** (p.digits - 1), 10**p.digits))
    lines = _chain_lines(p, names, value)
    noise = list(NOISE_SENTENCES)
    body = []
    for line in lines:
        body += noise[: rng.randrange(1, 4)] + [line]
    return (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        + " ".join(body)
        + f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
        f"\nAnswer: According to the chain(s) of variable assignment in the text above, {p.hops + 1} variables "
        f"are assigned the value {value}, they are: " + " ".join(names)
    )


def _cwe_list(rng: random.Random, n_uncommon: int, p: TaskParams) -> Tuple[List[str], List[str]]:
    words = list(CWE_WORDS)
    rng.shuffle(words)
    if p.common + 1 > len(words):
        raise ValueError(f"cwe: common must be below {len(words)} (got {p.common})")
    common, others = words[: p.common], words[p.common :]
    freq = max(p.uncommon_freq, -(-n_uncommon // len(others)))
    if freq >= p.common_freq:
        raise ValueError(
            f"cwe: the list needs each other word {freq} times, not fewer than the common words' "
            f"{p.common_freq}; raise common_freq or shorten the length"
        )
    pool = (others * freq)[:n_uncommon]
    items = common * p.common_freq + pool
    rng.shuffle(items)
    return items, common


def _build_cwe(tokenizer, length, seed, p: TaskParams, model, chat, head_ids) -> Context:
    fmt = CHATS[chat]
    enc = functools.partial(encode, tokenizer)
    head = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )
    if p.few_shot:
        ex_rng = random.Random(f"cwe-example:{seed}")
        ex_p = dataclasses.replace(p, common=min(p.common, 3), common_freq=3, uncommon_freq=1)
        ex_items, ex_common = _cwe_list(ex_rng, 12, ex_p)
        example = (
            head
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_items))
            + (
                f"\nQuestion: What are the {len(ex_common)} most common words in the above list?\nAnswer: The top "
                f"{len(ex_common)} words that appear most often in the list are: "
                + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common))
            )
        )
        head = example + "\n\n" + head
    head_ids = head_ids + enc(head)
    qa = [
        (
            f"Question: What are the {p.common} most common words in the above list?",
            f"Answer: The top {p.common} words that appear most often in the list are:",
            None,
        )
    ]
    tail = enc("\n")

    def draw(n_unc: int):
        items, common = _cwe_list(random.Random(f"cwe-list:{length}:{seed}:{n_unc}"), n_unc, p)
        said = " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
        qs = _questions(tokenizer, fmt, [(qa[0][0], qa[0][1], common, said)], p.margin)
        body = [enc(f" {i + 1}. {w}") for i, w in enumerate(items)]
        total = len(head_ids) + sum(map(len, body)) + len(tail) + len(qs[0].question_ids) + qs[0].max_new_tokens
        return total, body, qs

    # the largest number of other words that fits (bisection); each other word stays below common_freq
    lo, hi = 0, max(0, min(length - len(head_ids), (len(CWE_WORDS) - p.common) * (p.common_freq - 1)))
    best = draw(0)
    if best[0] > length:
        raise ValueError(f"cwe: length {length} is too short for {p.common} common words x {p.common_freq}")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = draw(mid)
        if got[0] <= length:
            lo, best = mid, got
        else:
            hi = mid - 1
    total, body, qs = best
    ids = list(head_ids)
    spans = []
    for u in body:
        ids += u
    ids += tail
    return Context(
        f"cwe-{WORDLIST}-{length}-{seed}",
        "cwe",
        length,
        WORDLIST,
        model,
        chat,
        seed,
        "all",
        ids,
        qs,
        spans,
        stop_ids(tokenizer, chat),
    )


def build_suite(
    tokenizer,
    tasks: Iterable[str] = TASKS,
    lengths: Iterable[int] = (4096,),
    haystacks: Iterable[str] = ("pydoc", NOISE),
    seeds: Iterable[int] = (0,),
    *,
    model: str = "",
    chat: str = "none",
    preset: str = DEFAULT_PRESET,
    params: Optional[Dict[str, TaskParams]] = None,
) -> List[Context]:
    """Every (task, length, haystack, seed) context; ``cwe`` once per (length, seed) (it has no haystack)."""
    out: List[Context] = []
    seen = set()
    for task in tasks:
        for length in lengths:
            for hay in haystacks:
                for seed in seeds:
                    key = (task, length, WORDLIST if task == "cwe" else hay, seed)
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append(
                        build_context(
                            tokenizer,
                            task,
                            length,
                            hay,
                            seed,
                            model=model,
                            chat=chat,
                            preset=preset,
                            params=(params or {}).get(task),
                        )
                    )
    return out


# ----------------------------------------------------------------------------- scoring (RULER's)
def postprocess(output: str) -> str:
    """RULER's post-processing: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip()


def score(output: str, answers: Sequence[str], metric: str = "all") -> float:
    """One output's score in [0, 1]: the share of ``answers`` in it (``all``), or 1 if any is (``part``).

    Case-insensitive substring match after :func:`postprocess`, as RULER's ``string_match_all`` /
    ``string_match_part`` score one prediction.
    """
    if metric not in ("all", "part"):
        raise ValueError(f"metric must be 'all' or 'part' (got {metric!r})")
    if not answers:
        raise ValueError("score needs at least one answer")
    pred = postprocess(output).lower()
    hits = [1.0 if str(a).lower() in pred else 0.0 for a in answers]
    return sum(hits) / len(hits) if metric == "all" else max(hits)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_all`` over a batch, 0-100."""
    if len(preds) != len(refs) or not preds:
        raise ValueError(f"need as many predictions as reference lists, at least one ({len(preds)}, {len(refs)})")
    return round(100 * sum(score(p, r, "all") for p, r in zip(preds, refs)) / len(preds), 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_part`` over a batch, 0-100."""
    if len(preds) != len(refs) or not preds:
        raise ValueError(f"need as many predictions as reference lists, at least one ({len(preds)}, {len(refs)})")
    return round(100 * sum(score(p, r, "part") for p, r in zip(preds, refs)) / len(preds), 2)


# ----------------------------------------------------------------------------- JSONL
def to_record(ctx: Context) -> Dict[str, Any]:
    """The JSONL line of a context (the module docstring's format)."""
    return {
        "id": ctx.id,
        "task": ctx.task,
        "length": ctx.length,
        "haystack": ctx.haystack,
        "model": ctx.model,
        "chat": ctx.chat,
        "metric": ctx.metric,
        "seed": ctx.seed,
        "context_ids": ctx.context_ids,
        "spans": [list(s) for s in ctx.spans],
        "stop_ids": ctx.stop_ids,
        "questions": [
            {
                "question": q.question,
                "question_ids": q.question_ids,
                "answers": q.answers,
                "max_new_tokens": q.max_new_tokens,
                "full_prompt_ids": ctx.full_prompt_ids(i),
            }
            for i, q in enumerate(ctx.questions)
        ],
    }


def write_jsonl(path, contexts: Iterable[Context]) -> Path:
    """One line per context; written to a temporary file and renamed (never half a file; a path that is not a
    regular file, a device or a directory, is refused: :func:`~kvpolicy_core.runtime.files.check_output_target`)."""
    from ...runtime.files import check_output_target

    path = Path(path)
    check_output_target(path, str(path))
    path = Path(os.path.realpath(path))  # a symlink is written through
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for ctx in contexts:
            f.write(json.dumps(to_record(ctx)) + "\n")
    check_output_target(path, str(path))
    tmp.replace(path)
    return path


def _ids(value, where: str, vocab_size: Optional[int] = None) -> List[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{where}: expected a list of token ids (non-negative integers)")
    if len(value) > MAX_LENGTH:
        raise ValueError(f"{where}: {len(value)} token ids, more than {MAX_LENGTH}")
    check_token_ids(value, vocab_size, where)
    return value


def _count(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LENGTH:
        raise ValueError(f"{where}: expected an integer in [1, {MAX_LENGTH}] (got {value!r})")
    return value


def from_record(rec: Dict[str, Any], where: str = "record", vocab_size: Optional[int] = None) -> Context:
    """A context from its JSONL line; ValueError naming the field for a malformed line. ``vocab_size``: the
    model's, which every token id must be below (:func:`~kvpolicy_core.integration.token_ids.check_token_ids`;
    None: not checked)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for field in ("id", "task", "length", "context_ids", "questions"):
        if field not in rec:
            raise ValueError(f"{where}: missing field {field!r}")
    questions = []
    if not isinstance(rec["questions"], list) or not rec["questions"]:
        raise ValueError(f"{where}: 'questions' must be a non-empty list")
    for i, q in enumerate(rec["questions"]):
        qw = f"{where}: questions[{i}]"
        if not isinstance(q, dict):
            raise ValueError(f"{qw}: expected a JSON object")
        for field in ("question_ids", "answers", "max_new_tokens"):
            if field not in q:
                raise ValueError(f"{qw}: missing field {field!r}")
        if not isinstance(q["answers"], list) or not q["answers"] or not all(isinstance(a, str) for a in q["answers"]):
            raise ValueError(f"{qw}.answers: expected a non-empty list of strings")
        n = _count(q["max_new_tokens"], f"{qw}.max_new_tokens")
        questions.append(
            Question(
                str(q.get("question", "")), _ids(q["question_ids"], f"{qw}.question_ids", vocab_size), q["answers"], n
            )
        )
    metric = rec.get("metric", "all")
    if metric not in ("all", "part"):
        raise ValueError(f"{where}.metric: must be 'all' or 'part' (got {metric!r})")
    return Context(
        str(rec["id"]),
        str(rec["task"]),
        _count(rec["length"], f"{where}.length"),
        str(rec.get("haystack", "")),
        str(rec.get("model", "")),
        str(rec.get("chat", "none")),
        int(rec.get("seed", 0)),
        metric,
        _ids(rec["context_ids"], f"{where}.context_ids", vocab_size),
        questions,
        [tuple(s) for s in rec.get("spans", [])],
        _ids(rec.get("stop_ids", []), f"{where}.stop_ids", vocab_size),
    )


def read_jsonl(path, vocab_size: Optional[int] = None) -> List[Context]:
    """The contexts of a JSONL file written by :func:`write_jsonl` (errors name the file and line); every token id
    below ``vocab_size`` (the model's: an id past its embedding is an out-of-bounds read; None: not checked)."""
    path = Path(path)
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{n}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: invalid JSON: {exc.msg}") from None
            out.append(from_record(rec, f"{path}:{n}", vocab_size))
    return out
