"""The config reference, written from the schema: each key's type, default, allowed values, rule and help as
`raypar.core.config.schema.key` declares them beside its field.

Two renderings: the Markdown tables of docs/config.md's "Config reference" section (`page`; `make
docs-config`, or `python -m raypar.core.config.reference`, writes it, and tests/unit/test_config_reference.py
fails when the page is stale), and the commented TOML `raypar config` prints for a resolved config
(`describe`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raypar.core.config.rules import MAX_SIZES
from raypar.core.config.schema import Config, toml_value

HEADING = "## Config reference"
PAGE = Path(__file__).resolve().parents[3] / "docs" / "config.md"
REGENERATE = "make docs-config (python -m raypar.core.config.reference)"
# [text](page.md): a link between docs pages, which a terminal shows as the page's path
DOC_LINK = re.compile(r"\[([^]]+)\]\(([^)]+\.md)\)")


@dataclass(frozen=True)
class Key:
    """One config key as the reference shows it."""

    section: str
    name: str
    type: str  # as the field is annotated: int, float, bool, str, list[int], int | str
    default: Any
    help: str
    choices: tuple[Any, ...]
    rule: str

    def allowed(self, quote: str = "") -> str:
        """The values it may take (each between `quote`s), the rule that binds it and its upper bound, as one
        phrase."""
        parts = [", ".join(quote + toml_value(c) + quote for c in self.choices)] if self.choices else []
        parts += [self.rule] if self.rule else []
        bound = MAX_SIZES.get(f"{self.section}.{self.name}")
        if bound is not None:
            parts.append(f"at most {_power(bound)}")
        return "; ".join(parts)


def _power(n: int) -> str:
    """A bound as a reader takes it in: 2^k for the large powers of two MAX_SIZES holds, else the number."""
    return f"2^{n.bit_length() - 1}" if n >= 2**16 and n & (n - 1) == 0 else str(n)


def sections(config: type = Config) -> dict[str, type]:
    """Each TOML section's name and dataclass, in the schema's order."""
    return {f.name: f.default_factory for f in dataclasses.fields(config)}


def keys(section: str, cls: type) -> list[Key]:
    """The keys of one section's dataclass, in the order they are declared."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        meta = f.metadata
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(Key(section, f.name, annotation, default, meta.get("help", ""), meta.get("choices", ()),
                       meta.get("rule", "")))
    return out


def missing_help(config: type = Config) -> list[str]:
    """`section.key` of every field declared without help (a plain default instead of `schema.key`)."""
    every = [k for name, cls in sections(config).items() for k in keys(name, cls)]
    return [f"{k.section}.{k.name}" for k in every if not k.help.strip()]


def _paragraphs(doc: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line."""
    text = inspect.cleandoc(doc or "")
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(config: type = Config) -> str:
    """The reference section: the schema's own notes, then a table per section."""
    lines = [
        HEADING,
        "",
        f"<!-- Generated from raypar/core/config/schema.py by {REGENERATE}: edit the help there. -->",
        "",
    ]
    for paragraph in _paragraphs(config.__doc__):
        lines += [paragraph, ""]
    for name, cls in sections(config).items():
        lines += [f"### `[{name}]`", ""]
        for paragraph in _paragraphs(cls.__doc__):
            lines += [paragraph, ""]
        lines += ["| key | type | default | allowed | help |", "| --- | --- | --- | --- | --- |"]
        for k in keys(name, cls):
            kind, default = k.type.replace(" | ", " or "), f"`{toml_value(k.default)}`"
            row = (f"`{k.name}`", kind, default, k.allowed("`"), k.help)
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def page(current: str, config: type = Config) -> str:
    """docs/config.md as it should be: its hand-written part (everything above the reference heading) kept,
    the reference regenerated."""
    intro, heading, _ = current.partition(HEADING)
    if not heading:
        raise ValueError(f"docs/config.md: no {HEADING!r} heading to write the reference under")
    return intro + markdown(config)


def stale(current: str, config: type = Config) -> str | None:
    """None when `current` (docs/config.md's text) holds the reference the schema gives, else what differs
    and the command that regenerates it."""
    wanted = page(current, config)
    if wanted == current:
        return None
    diff = difflib.unified_diff(current.splitlines(), wanted.splitlines(), "docs/config.md", "schema", n=0)
    first = [line for line in diff if line[:1] in "+-" and line[:3] not in ("---", "+++")][:2]
    return (
        f"docs/config.md is stale against the schema ({' / '.join(first)[:300]}); regenerate it: {REGENERATE}"
    )


def describe(cfg: Config, only: str | None = None, width: int = 110) -> str:
    """`raypar config`: a section (or all) as TOML with the config's values, each key's help, type, allowed
    values and default above it as comments (so the output is itself a config)."""
    out = []
    for name, cls in sections(type(cfg)).items():
        if only is not None and name != only:
            continue
        out += _comment(" ".join(_paragraphs(cls.__doc__)), width) + [f"[{name}]"]
        for k in keys(name, cls):
            facts = [k.type.replace(" | ", " or "), k.allowed()] if k.allowed() else [k.type]
            facts.append(f"default {toml_value(k.default)}")
            out += _comment(k.help, width) + _comment("; ".join(facts), width)
            out.append(f"{k.name} = {toml_value(getattr(getattr(cfg, name), k.name))}")
        out.append("")
    return "\n".join(out)


def _comment(text: str, width: int) -> list[str]:
    """Markdown as a terminal reads it: links to the docs pages as their paths, no backticks."""
    plain = DOC_LINK.sub(lambda m: f"{m[1]} (docs/{m[2]})", text).replace("`", "")
    return textwrap.wrap(plain, width, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def main() -> int:
    if not PAGE.is_file():
        print(f"raypar: {PAGE}: not found (the reference is written into a source checkout)", file=sys.stderr)
        return 2
    PAGE.write_text(page(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"raypar: wrote the config reference into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
