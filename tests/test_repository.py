"""The repository as a newcomer clones it: self-contained (nothing points outside it), the package apart from the
lab notebook (experiments/ indexed, never imported by verispec/)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_nothing_points_outside_the_clone():
    texts = [p for p in tracked() if p.suffix in (".py", ".md", ".toml", ".yml", ".yaml", ".sh") or p.name == "run"]
    outside = "../" + "shared"  # spelled apart, so this file does not name it
    offenders = [str(p.relative_to(ROOT)) for p in texts if p.exists() and outside in p.read_text(errors="replace")]
    assert not offenders


def test_experiments_live_apart_and_each_is_indexed():
    assert not (ROOT / "scripts").exists()
    index = (ROOT / "experiments" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "experiments").glob("*.py"))
    assert scripts and [s for s in scripts if f"| {s} |" not in index] == []
    importing = [str(p.relative_to(ROOT)) for p in (ROOT / "verispec").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+experiments\b", p.read_text(), re.M)]
    assert not importing


def test_the_loop_calls_hooks_instead_of_probing_for_them():
    """The engine, the batch loop and the drafters call a target's and a drafter's optional hooks and read their
    capabilities as they are: the defaults live in ``TargetModelBase`` and ``DrafterBase`` (which the engine requires),
    so adding a hook never means a lookup, and no drafter asks which backend it runs on by probing."""
    probe = re.compile(r"\b(hasattr|getattr)\(\s*(self\.|decoder\.|self\._)?(target|drafter|draft|draft_model)\b")
    files = ["engine.py", "batching.py", *(f"drafters/{p.name}" for p in (ROOT / "verispec" / "drafters").glob("*.py")),
             "eagle/engines.py"]
    found = {name: probe.findall((ROOT / "verispec" / name).read_text()) for name in files}
    assert {name: hits for name, hits in found.items() if hits} == {}



def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve():
    """Every relative link in the README and docs/ names a file of the clone and, with #anchor, one of its headings."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s:]*)(?:#([^)\s]+))?\)", page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md":
                headings = {_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}
                if anchor not in headings:
                    broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken
