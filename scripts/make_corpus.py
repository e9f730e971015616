"""Build the recipes' default corpus, recipes/corpus/corpus.txt, from text on any Python install.

The corpus is the docstrings (module, class and function) of the Python standard library's own
source files, read with ``ast`` (nothing is imported or executed), in sorted file order, one
document per docstring separated by a blank line and a form feed. The text is Python's
documentation, © Python Software Foundation, redistributable under the PSF License Agreement;
the license text of this interpreter is copied next to the corpus as CORPUS_LICENSE.txt.

    python scripts/make_corpus.py            # writes recipes/corpus/corpus.txt (~2 MB)
    python scripts/make_corpus.py --max-mb 1 --out /tmp/corpus.txt

The output depends only on the Python version's stdlib sources, so a rerun on the same Python
reproduces the committed file byte for byte.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "ensurepip", "turtledemo"}
SEP = "\n\n\f\n"  # document separator; the byte tokenizer keeps it, the data loader splits on it


def docstrings(path: Path) -> list[str]:
    """Every module/class/function docstring of one source file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 80 and doc.isascii():  # skip one-liners; ASCII keeps bytes == chars
                out.append(doc.strip())
    return out


def _shown(path: Path) -> str:
    """``path`` as the license header names it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "recipes" / "corpus" / "corpus.txt")
    parser.add_argument("--max-mb", type=float, default=2.0, help="stop after this many MB of text")
    args = parser.parse_args(argv)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(stdlib).parts[:-1]))
    limit, size, seen, docs = int(args.max_mb * 1e6), 0, set(), []
    for path in files:
        for doc in docstrings(path):
            if doc in seen:  # inherited/copied docstrings would be memorised, not learned
                continue
            seen.add(doc)
            docs.append(doc)
            size += len(doc) + len(SEP)
        if size >= limit:
            break
    if not docs:
        raise SystemExit(f"no docstrings found under {stdlib}; is this a full Python install?")
    text = SEP.join(docs)[:limit] + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="ascii")
    lic = stdlib / "LICENSE.txt"
    header = (
        f"{_shown(args.out)}: docstrings of the Python {sys.version.split()[0]} standard library,\n"
        "extracted by scripts/make_corpus.py. Copyright (c) Python Software Foundation; all rights reserved.\n"
        "Redistributed under the PSF License Agreement, reproduced below.\n\n"
    )
    (args.out.parent / "CORPUS_LICENSE.txt").write_text(
        header + (lic.read_text(encoding="utf-8") if lic.exists() else "See https://docs.python.org/3/license.html\n"),
        encoding="utf-8",
    )
    print(f"wrote {args.out}: {len(text) / 1e6:.2f} MB, {len(docs)} docstrings from {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
