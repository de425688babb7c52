"""The README and docs/ stay true: links and headings they point to exist, every python block compiles and
the self-contained ones run (the README's quickstart is ``examples/quickstart.py``; it and
``examples/data_parallel.py`` run on 2 ranks), every shell block names scripts, files and modules that exist,
and every public name (``fxshard.__all__``) has a docstring and is listed in docs/plans.md's API section."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

import fxshard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)  # also indented (in list items)


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _blocks(lang: str) -> list[tuple[str, str]]:
    return [(page, textwrap.dedent(m.group(3))) for page in PAGES for m in FENCE.finditer(_text(page))
            if m.group(2) == lang]


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: str) -> set[str]:
    text = FENCE.sub("", _text(page))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_readme_opens_with_the_two_commands_and_stays_short():
    text = _text("README.md")
    assert len(text.splitlines()) <= 250
    first = [m.group(3).strip() for m in FENCE.finditer(text)][:2]
    assert first[0].startswith("bash scripts/demo.sh") and first[1].startswith("bash scripts/test.sh"), first
    assert text.index("```bash") < text.index("## "), "the two commands come before any section"


def test_every_relative_link_and_anchor_exists():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", _text(page))):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(ROOT, page)
            if not os.path.exists(full):
                bad.append(f"{page}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in _anchors(os.path.relpath(full, ROOT)):
                bad.append(f"{page}: {target} (no such heading)")
    assert not bad, bad


def test_every_python_block_compiles():
    blocks = _blocks("python")
    assert len(blocks) >= 5
    for page, code in blocks:
        try:
            ast.parse(code)
        except SyntaxError as e:
            pytest.fail(f"{page}: a python block does not compile ({e}):\n{code}")


def _words(code: str) -> list[list[str]]:
    lines = [l.split("#", 1)[0].strip() for l in code.replace("\\\n", " ").splitlines()]
    return [shlex.split(l) for l in lines if l]


def test_every_shell_block_names_what_exists():
    bad = []
    for page, code in _blocks("bash"):
        for words in _words(code):
            for i, w in enumerate(words):
                if re.fullmatch(r"[\w./-]+\.(sh|py)", w) and not os.path.exists(os.path.join(ROOT, w)):
                    bad.append(f"{page}: {w}")
                if w == "-m" and i + 1 < len(words) and words[i + 1] not in ("pip", "pytest") and \
                        importlib.util.find_spec(words[i + 1]) is None:
                    bad.append(f"{page}: python -m {words[i + 1]}")
            if words[:2] == ["fxshard", "plan"]:
                for ref in [words[2]] + [w for k, w in zip(words, words[1:]) if k == "--plan" and w != "hf"]:
                    mod, _, attr = ref.partition(":")
                    if not hasattr(importlib.import_module(mod), attr):
                        bad.append(f"{page}: fxshard plan {ref}")
    assert not bad, bad


def test_the_readme_quickstart_is_examples_quickstart():
    block = next(code for page, code in _blocks("python") if page == "README.md")
    source = _text(os.path.join("examples", "quickstart.py"))
    body = source[source.index('"""', 3) + 3:].strip()
    assert block.strip() == body, "README's quickstart block differs from examples/quickstart.py"


def test_the_self_contained_examples_run_on_two_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for script, expect in (("examples/quickstart.py", "'all_reduce': {'count': 1"),
                           ("examples/data_parallel.py", "after 3 SGD steps")):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and expect in r.stdout, (script, r.stdout, r.stderr[-3000:])


def test_every_public_name_has_a_docstring_the_docs_list():
    api = _text(os.path.join("docs", "plans.md")).split("## API", 1)[1]
    missing_doc = [n for n in fxshard.__all__ if not (getattr(fxshard, n).__doc__ or "").strip()]
    unlisted = [n for n in fxshard.__all__ if f"`{n}`" not in api]
    assert not missing_doc and not unlisted, (missing_doc, unlisted)
