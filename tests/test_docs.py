"""Every Python code block of README.rst and of the documentation (docs/**/*.rst) runs.

A page's blocks run in order in one namespace, as a reader would paste them. Two markers, both
RST comments (invisible on GitHub, PyPI and the built site; the names are sybil's):

- ``.. invisible-code-block: python`` followed by an indented block: code that runs at that
  point but is not shown (small real data standing in for a reader's ``loader``, ``x``, ...);
- ``.. skip: next``: the next code block is not run (it needs several processes or machines).

A page whose code imports a peer library that is not installed (BackPACK, ASDL: the ``bench``
extra) is skipped, naming it. Every public name of the package is in the API reference.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import per_sample_hooks as psh

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.rst",
         *sorted(p for p in (ROOT / "docs").rglob("*.rst") if "_build" not in p.parts)]
OPTIONAL_PEERS = {"backpack", "asdl", "asdfghjkl", "opacus", "transformers"}
START = re.compile(r"^\.\. (code-block:: python|invisible-code-block: python)\s*$")
SKIP = re.compile(r"^\.\. skip: next\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of its first line, code)`` of each Python block to run, in order."""
    lines, blocks, skip_next, i = text.splitlines(), [], False, 0
    while i < len(lines):
        if SKIP.match(lines[i]):
            skip_next = True
        if not START.match(lines[i]):
            i += 1
            continue
        i += 1
        while i < len(lines) and lines[i].strip().startswith(":"):  # directive options
            i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            body.append(lines[i])
            i += 1
        indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
        if not skip_next:
            blocks.append((i - len(body) + 1, "\n".join(line[indent:] for line in body)))
        skip_next = False
    return blocks


def pages_with_code() -> list[Path]:
    return [page for page in PAGES if python_blocks(page.read_text())]


@pytest.mark.parametrize("page", pages_with_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page: Path) -> None:
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, code in python_blocks(page.read_text()):
        try:
            # padded so that a traceback names the page's own line numbers
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
        except ModuleNotFoundError as error:
            if error.name and error.name.split(".")[0] in OPTIONAL_PEERS:
                pytest.skip(f"{page.name} needs {error.name} (pip install '.[bench]')")
            raise


def test_blocks_are_found() -> None:
    """The extraction itself: options skipped, dedented, invisible blocks kept, skips honoured."""
    text = ("Text\n\n.. code-block:: python\n   :emphasize-lines: 1\n\n    a = 1\n\n    b = a\n"
            "back to text\n\n.. invisible-code-block: python\n\n    c = 2\n\n.. skip: next\n\n"
            ".. code-block:: python\n\n    raise SystemExit\n\n.. code-block:: python\n\n"
            "  d = 3\n")
    assert [code.strip() for _, code in python_blocks(text)] == ["a = 1\n\nb = a", "c = 2",
                                                                  "d = 3"]


def test_every_public_name_is_documented() -> None:
    """Each name of ``__all__`` (package, dp, distributed, optim, curvature) has its entry in
    docs/api: an explicit ``auto*`` directive, or ``automodule :members:`` of its module."""
    api = "\n".join(page.read_text() for page in (ROOT / "docs" / "api").glob("*.rst"))
    documented = set(re.findall(r"^\.\. auto\w+:: (?:per_sample_hooks\.)?([\w.]+)", api, re.M))
    whole = {m for m in documented if m in {"dp", "distributed", "optim"}}
    wanted = [name for name in psh.__all__ if name not in {"dp", "distributed", "optim"}]
    assert {"dp", "distributed", "optim"} <= whole
    missing = [name for name in wanted if name not in documented]
    assert not missing, f"not in docs/api: {missing}"
    for module in ("dp", "distributed", "optim"):
        assert f"automodule:: per_sample_hooks.{module}\n   :members:" in api
    assert set(psh.curvature.__all__) <= documented
