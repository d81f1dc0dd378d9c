"""A strict parser of Prometheus' text exposition format (0.0.4), for tests.

It accepts only what the format allows: ``# HELP name text`` and
``# TYPE name kind`` lines before a family's samples (each at most once),
samples ``name{label="value",...} number [timestamp]`` whose name is the
family's (or, for a summary or histogram, with ``_sum``/``_count``/
``_bucket``), label values with only the ``\\\\``, ``\\"`` and ``\\n``
escapes, the families' samples contiguous, and a final newline.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_HELP = re.compile(rf"# HELP ({NAME}) (.*)")
_TYPE = re.compile(rf"# TYPE ({NAME}) (counter|gauge|summary|histogram|untyped)")
_SAMPLE = re.compile(rf"({NAME})(?:\{{(.*)\}})? (\S+)(?: (-?\d+))?")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
_SUFFIXES = {"summary": ("", "_sum", "_count"), "histogram": ("_sum", "_count", "_bucket")}


class FormatError(AssertionError):
    """The text breaks the exposition format."""


@dataclass
class ParsedFamily:
    name: str
    kind: str = "untyped"
    help: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), text)


def _value(text: str, line: str) -> float:
    if text in ("NaN", "+Inf", "-Inf"):
        return {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}[text]
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise FormatError(f"bad sample value {text!r} in {line!r}")
    return float(text)


def _labels(text: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    rest = text
    while rest:
        match = _LABEL.match(rest)
        if match is None:
            raise FormatError(f"bad labels in {line!r}")
        name, value, comma = match.groups()
        if name in labels:
            raise FormatError(f"label {name!r} twice in {line!r}")
        labels[name] = _unescape(value)
        rest = rest[match.end() :]
        if comma == "," and not rest:
            break  # a trailing comma is allowed
    return labels


def _family_of(sample: str, families: dict[str, ParsedFamily]) -> ParsedFamily:
    for family in families.values():
        suffixes = _SUFFIXES.get(family.kind, ("",))
        if any(sample == family.name + suffix for suffix in suffixes):
            return family
    return families.setdefault(sample, ParsedFamily(sample))


def parse(text: str) -> dict[str, ParsedFamily]:
    """Parse exposition text strictly; raise :class:`FormatError` on any breach."""
    if not text.endswith("\n"):
        raise FormatError("the text does not end with a newline")
    families: dict[str, ParsedFamily] = {}
    closed: set[str] = set()
    current: str | None = None
    for line in text[:-1].split("\n"):
        if line.startswith("#"):
            help_match, type_match = _HELP.fullmatch(line), _TYPE.fullmatch(line)
            if help_match is None and type_match is None:
                if line.startswith(("# HELP", "# TYPE")):
                    raise FormatError(f"bad metadata line {line!r}")
                continue  # a comment
            match = help_match or type_match
            assert match is not None
            name = match.group(1)
            family = families.setdefault(name, ParsedFamily(name))
            if family.samples or name in closed:
                raise FormatError(f"metadata of {name} after its samples: {line!r}")
            if help_match is not None:
                if family.help is not None:
                    raise FormatError(f"second HELP for {name}")
                family.help = _unescape(help_match.group(2).replace('\\"', '"'))
            else:
                if family.kind != "untyped" and type_match is not None:
                    raise FormatError(f"second TYPE for {name}")
                family.kind = match.group(2)
            continue
        if not line.strip():
            continue
        sample = _SAMPLE.fullmatch(line)
        if sample is None:
            raise FormatError(f"bad sample line {line!r}")
        name, labels, value, _ = sample.groups()
        family = _family_of(name, families)
        if family.name in closed:
            raise FormatError(f"samples of {family.name} are not contiguous")
        if current is not None and current != family.name:
            closed.add(current)
        current = family.name
        if family.kind == "counter" and _value(value, line) < 0:
            raise FormatError(f"negative counter in {line!r}")
        family.samples.append((name, _labels(labels or "", line), _value(value, line)))
    return families
