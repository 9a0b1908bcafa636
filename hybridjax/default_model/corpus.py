"""The default model's training text, made from what every Python installation carries: the
language reference topics of `pydoc_data.topics` and the docstrings of a fixed list of standard
library modules, as plain text and as chat pairs ("What does json.dumps do?" -> its signature
and docstring).

Deterministic for one Python version: modules, names and topics are visited in sorted order,
and the held-out split is a hash of each document's name. The text differs between Python
versions (docstrings change), so the build records the version that made the shipped weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import re
import warnings

# Well-known modules whose import has no side effects (no window, no browser, no printing).
MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins calendar cmath codecs collections "
    "collections.abc colorsys concurrent.futures configparser contextlib copy csv dataclasses datetime "
    "decimal difflib dis enum filecmp fnmatch fractions functools gc getpass gettext glob graphlib gzip "
    "hashlib heapq hmac html html.parser http http.client http.server inspect io ipaddress itertools json "
    "keyword linecache locale logging lzma math mimetypes numbers operator os os.path pathlib pickle "
    "pkgutil platform pprint queue random re reprlib sched secrets select selectors shlex shutil signal "
    "socket sqlite3 stat statistics string struct subprocess sys sysconfig tarfile tempfile textwrap "
    "threading time timeit tokenize traceback types typing unicodedata unittest urllib.parse "
    "urllib.request uuid warnings weakref xml.etree.ElementTree zipfile zlib zoneinfo"
).split()

HELD_OUT_PERCENT = 3  # documents whose name hashes below this go to the held-out set
MAX_ANSWER_CHARS = 1200  # chat answers: the signature and the docstring, cut at a paragraph


def held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def _signature(obj, name: str) -> str:
    try:
        sig = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name
    return re.sub(r" at 0x[0-9a-fA-F]+", "", sig)  # default-value reprs carry memory addresses


def _cut(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """The first paragraphs of text that fit in `limit` characters (at least the first one)."""
    out = ""
    for para in text.split("\n\n"):
        if out and len(out) + len(para) + 2 > limit:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[: limit * 2]


def _members(mod):
    """(qualified name, object) for the public functions and classes a module defines, and the
    public methods of those classes, sorted by name."""
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for n in sorted(set(names)):
        obj = getattr(mod, n, None)
        if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
            continue
        home = getattr(obj, "__module__", "") or ""
        if home != mod.__name__ and not (home.startswith("_") or home.lstrip("_") == mod.__name__.split(".")[-1]):
            continue  # imported from elsewhere: documented there
        yield f"{mod.__name__}.{n}", obj
        if inspect.isclass(obj):
            for m in sorted(vars(obj)):
                f = vars(obj)[m]
                if not m.startswith("_") and (inspect.isfunction(f) or inspect.ismethoddescriptor(f)):
                    yield f"{mod.__name__}.{n}.{m}", getattr(obj, m)


def documents() -> list[dict]:
    """Every document: {"name", "text", "chat": [{"messages": ...}, ...]}, in a fixed order."""
    docs = []
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = topics[key].strip()
        q = f"Explain the Python topic '{key}'."
        docs.append({"name": f"topic:{key}", "text": text,
                     "chat": [_pair(q, _cut(text))]})
    for modname in MODULES:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
        doc = inspect.getdoc(mod)
        if doc:
            docs.append({"name": f"module:{modname}", "text": f"Module {modname}\n\n{doc}",
                         "chat": [_pair(f"What is the {modname} module for?", _cut(doc))]})
        for qual, obj in _members(mod):
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 20:
                continue
            sig = _signature(obj, qual)
            kind = "class" if inspect.isclass(obj) else "function"
            docs.append({"name": qual, "text": f"{sig}\n\n{doc}",
                         "chat": [_pair(f"What does {qual} do?", f"{sig}\n\n{_cut(doc)}"),
                                  _pair(f"Which {kind} in {modname} would I read about for: {doc.splitlines()[0]}",
                                        f"{qual}: {sig}")]})
    return docs


def _pair(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def examples(docs: list[dict]) -> list[dict]:
    """Training examples of documents: each text, then each chat pair."""
    out = []
    for d in docs:
        out.append({"text": d["text"]})
        out += d["chat"]
    return out


def fingerprint(docs: list[dict]) -> str:
    """sha256 of the documents: the same string means the same training text."""
    h = hashlib.sha256()
    for d in docs:
        h.update(repr((d["name"], d["text"], d["chat"])).encode())
    return h.hexdigest()
