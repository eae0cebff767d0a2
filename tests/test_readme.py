"""The README's Python example runs as written, and the README's and docs' relative links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_python_example_runs(tmp_path):
    (example,) = _blocks((ROOT / "README.md").read_text(), "python")
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout host holds step 2 bit-exact" in proc.stdout


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' dropped, spaces to '-'."""
    out = set()
    for line in re.sub(r"^```.*?^```", "", md.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_readme_and_docs_links_resolve():
    bad = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)
