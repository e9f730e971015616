"""The README: shows examples/train_minimal.py verbatim, links every docs/ page, points nowhere outside the repo."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_shows_the_minimal_example_verbatim():
    code = (ROOT / "examples" / "train_minimal.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert code in blocks, "README.md must show examples/train_minimal.py exactly (copy it into the python block)"


def test_readme_links_every_doc_and_nothing_outside():
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in README, f"README.md's Docs list misses docs/{doc.name}"
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if target.startswith(("http://", "https://")):
            continue
        assert not target.startswith(("..", "/")), target


def test_readme_test_command_is_ci():
    assert "bash scripts/test.sh" in README and "bash scripts/pretrain.sh" in README
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _repository_files() -> list[Path]:
    """Files a clone carries: git's tracked and not-ignored files; without git, skip dot and build folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode()
        return [ROOT / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {"runs", "out", "build", "dist", "__pycache__"}
        return [
            path for path in ROOT.rglob("*")
            if not any(part.startswith(".") or part in skip for part in path.relative_to(ROOT).parts[:-1])
        ]


def test_no_path_outside_the_repository():
    # The repository must not read or link anything beside it (a fresh clone has nothing there). Caches the
    # tools write into the work tree (.hypothesis holds absolute paths) are ignored by git and not checked.
    bad = re.compile(r"\.\./" + "shared" + "|" + "/" + "work/")  # built from pieces so this file does not match
    offenders = []
    for path in _repository_files():
        if not path.is_file() or path.suffix in (".png", ".pyc"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(text.splitlines(), 1) if bad.search(line)]
    assert not offenders, offenders
