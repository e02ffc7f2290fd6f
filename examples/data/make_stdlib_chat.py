"""Write examples/data/stdlib_chat.jsonl: a few hundred conversations about the Python standard library,
each answer the first paragraph of a docstring (so the facts are the library's own, and nothing is
downloaded). Deterministic for one Python version; the committed file was made with Python 3.11.

    python examples/data/make_stdlib_chat.py   # from the repository root
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

MODULES = [
    "bisect",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "datetime",
    "difflib",
    "enum",
    "fnmatch",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "os.path",
    "pathlib",
    "random",
    "re",
    "shutil",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "time",
    "uuid",
    "zlib",
]
SYSTEM = "You answer questions about the Python standard library in one short paragraph."
MAX_ANSWER = 400  # characters: short turns keep the example's samples small
OUT = Path(__file__).with_name("stdlib_chat.jsonl")


def first_paragraph(obj: object) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    text = " ".join(doc.split("\n\n")[0].split())
    return text[:MAX_ANSWER] if len(text) > 20 else None


def conversations() -> list[dict]:
    rows = []
    for name in MODULES:
        module = importlib.import_module(name)
        about = first_paragraph(module)
        members = sorted(n for n in dir(module) if not n.startswith("_"))
        answers = [(n, first_paragraph(getattr(module, n))) for n in members]
        answers = [(n, a) for n, a in answers if a][:12]
        for member, answer in answers:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What does {name}.{member} do?"},
                {"role": "assistant", "content": answer},
            ]
            if about and len(rows) % 3 == 0:  # some two-turn conversations: the module first, then the member
                messages[1:1] = [
                    {"role": "user", "content": f"What is the {name} module for?"},
                    {"role": "assistant", "content": about},
                ]
            rows.append({"messages": messages})
    return rows


if __name__ == "__main__":
    rows = conversations()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} conversations, {OUT.stat().st_size:,} bytes -> {OUT}")
