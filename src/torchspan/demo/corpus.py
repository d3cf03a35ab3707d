"""The demo's training text, made by torchspan itself: its installed source and a small grammar.

Usage::

    corpus = build_corpus("package")          # torchspan's own .py files and docstrings
    x, y = corpus.batch(32, 64, generator)     # next-character prediction pairs

``"package"`` reads every ``.py``/``.md``/``.txt`` file shipped inside the installed ``torchspan``
package (via ``importlib.resources``), so the text is whatever version is installed. ``"grammar"``
generates sentences about devices, stages and schedules from a seeded grammar. ``"both"`` joins them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable

import torch

__all__ = ["Corpus", "build_corpus", "package_text", "grammar_text", "SOURCES"]

SOURCES = ("package", "grammar", "both")
# Printable ASCII plus newline; anything else becomes "?" so the vocabulary stays small and fixed.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
_UNKNOWN = "?"
_INDEX = {c: i for i, c in enumerate(ALPHABET)}
_SUFFIXES = (".py", ".md", ".txt")


def _walk(node: Traversable, prefix: str = "") -> list[tuple[str, Traversable]]:
    out: list[tuple[str, Traversable]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        name = f"{prefix}{child.name}"
        if child.is_dir():
            if child.name.startswith((".", "__pycache__")):
                continue
            out.extend(_walk(child, name + "/"))
        elif child.name.endswith(_SUFFIXES):
            out.append((name, child))
    return out


def package_text(package: str = "torchspan") -> str:
    """All text files of the installed ``package``, each headed by ``# file: <path>``, sorted by path."""
    try:
        root = resources.files(package)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"package={package!r} is not installed; the demo corpus reads an installed package's files"
        ) from exc
    parts = []
    for name, node in _walk(root):
        try:
            text = node.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(f"# file: {package}/{name}\n{text.rstrip()}\n")
    if not parts:
        raise ValueError(
            f"package={package!r} ships no {'/'.join(_SUFFIXES)} files to read; use source='grammar'"
        )
    return "\n".join(parts)


_GRAMMAR: dict[str, list[str]] = {
    "S": [
        "The planner puts {LAYERS} on {DEV} because {REASON}.",
        "Stage {N} runs {LAYERS} on {DEV} and sends {TENSOR} to stage {M}.",
        "With {K} micro-batches the {SCHED} schedule keeps {DEV} busy {SHARE} of the step.",
        "A budget of {SIZE} on {DEV} leaves room for {KIND} but not for {KIND}.",
        "{DEV} computes the forward of micro-batch {N} while {DEV} runs the backward of micro-batch {M}.",
        "Gradients on {DEV} match a single-device run to the last bit for {LAYERS}.",
    ],
    "LAYERS": [
        "the embedding",
        "blocks {N} to {M}",
        "the final norm and the head",
        "block {N}",
        "every layer",
    ],
    "DEV": ["cuda:0", "cuda:1", "the CPU", "cpu", "mps", "the second GPU"],
    "REASON": [
        "its memory is full",
        "pipelining hides the transfer",
        "the optimizer state needs {SIZE}",
        "activations of {K} micro-batches are alive at once",
        "the link to the host is slow",
    ],
    "TENSOR": ["a {N} by {M} activation", "the hidden states", "the logits"],
    "SCHED": ["GPipe", "1F1B"],
    "SHARE": ["half", "most", "nine tenths", "all but the bubble"],
    "SIZE": ["{N} GiB", "{N}00 MiB", "{N}.{M} GB"],
    "KIND": [
        "the parameters",
        "the gradients",
        "the Adam moments",
        "the saved activations",
        "the transfer buffers",
    ],
    "N": [str(i) for i in range(10)],
    "M": [str(i) for i in range(10)],
    "K": ["2", "4", "8", "16"],
}


def _expand(symbol: str, rng: random.Random) -> str:
    template = rng.choice(_GRAMMAR[symbol])
    out, i = [], 0
    while i < len(template):
        if template[i] == "{":
            j = template.index("}", i)
            out.append(_expand(template[i + 1 : j], rng))
            i = j + 1
        else:
            out.append(template[i])
            i += 1
    return "".join(out)


def grammar_text(sentences: int = 3000, seed: int = 0) -> str:
    """``sentences`` sentences from torchspan's small grammar, deterministic for a given ``seed``."""
    if sentences < 1:
        raise ValueError(f"sentences={sentences!r} must be >= 1")
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        lines.append(_expand("S", rng))
        if i % 4 == 3:
            lines.append("\n")
        else:
            lines.append(" ")
    return "".join(lines)


def _encode(text: str) -> torch.Tensor:
    """Character ids of ``text`` in ``ALPHABET``; characters outside it become ``"?"``."""
    unk = _INDEX[_UNKNOWN]
    return torch.tensor([_INDEX.get(c, unk) for c in text], dtype=torch.long)


@dataclass
class Corpus:
    """Encoded text with a fixed character vocabulary (``ALPHABET``)."""

    text: str
    data: torch.Tensor  # int64 character ids
    source: str

    @property
    def vocab_size(self) -> int:
        return len(ALPHABET)

    def encode(self, text: str) -> torch.Tensor:
        """Character ids of ``text``; characters outside ``ALPHABET`` become ``"?"``."""
        return _encode(text)

    @staticmethod
    def decode(ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(ALPHABET[i] for i in values)

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs ``(batch_size, seq_len)`` and the same windows shifted by one."""
        if seq_len + 2 > len(self.data):  # randint needs a non-empty range of window starts
            raise ValueError(
                f"seq_len={seq_len} needs at least {seq_len + 2} characters; the corpus has {len(self.data)}"
            )
        starts = torch.randint(0, len(self.data) - seq_len - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        windows = self.data[idx]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def build_corpus(source: str = "package", *, seed: int = 0) -> Corpus:
    """The demo corpus: ``"package"`` (torchspan's installed files), ``"grammar"`` or ``"both"``."""
    if source == "package":
        text = package_text()
    elif source == "grammar":
        text = grammar_text(seed=seed)
    elif source == "both":
        text = package_text() + "\n" + grammar_text(seed=seed)
    else:
        raise ValueError(f"source={source!r} is not one of {', '.join(SOURCES)}")
    return Corpus(text=text, data=_encode(text), source=source)
