"""Run the fault suite and write its scenario table into docs/RELIABILITY.md.

Why a script: the table in RELIABILITY.md must be what the tests did on this tree, not prose that
drifts. A small pytest plugin collects, per test, its docstring (what the scenario asserts), the
`injected` / `observed` properties the test recorded with `record_property`, the outcome and the
time; the rows replace the marked sections of the document. The security tests (signing, verify,
hostile input, and the adversarial-review hardening tests) are included when they exist, in their
own marked section.

    .venv/bin/python scripts/reliability_report.py            # run everything, rewrite the tables
    .venv/bin/python scripts/reliability_report.py -- -k flip # extra pytest arguments after --
    .venv/bin/python scripts/reliability_report.py --check    # run, print, leave the document alone

Exit status: 0 when every scenario held, 1 otherwise (the table is written either way).
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RELIABILITY.md"
FAULT_FILES = ["tests/test_faults_store.py", "tests/test_faults_crash.py", "tests/test_faults_load.py"]
SECURITY_FILES = ["tests/test_signing.py", "tests/test_verify.py", "tests/test_hostile_store.py",
                  "tests/test_writer_hardening.py", "tests/test_watcher_hardening.py", "tests/test_fanout_hardening.py"]
MARKERS = {"faults": ("<!-- fault-table:begin -->", "<!-- fault-table:end -->"),
           "security": ("<!-- security-rows:begin -->", "<!-- security-rows:end -->")}


@dataclass
class Row:
    nodeid: str
    doc: str = ""
    outcome: str = "not run"
    seconds: float = 0.0
    props: dict[str, str] = field(default_factory=dict)
    message: str = ""

    @property
    def file(self) -> str:
        return self.nodeid.split("::")[0]

    @property
    def name(self) -> str:
        return self.nodeid.split("::", 1)[1]


class Collector:
    """pytest plugin: one Row per test, in collection order."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            doc = getattr(getattr(item, "obj", None), "__doc__", None) or ""
            self.rows[item.nodeid] = Row(item.nodeid, " ".join(doc.split()))

    def pytest_runtest_logreport(self, report) -> None:
        row = self.rows.setdefault(report.nodeid, Row(report.nodeid))
        row.seconds += report.duration
        row.props.update({k: str(v) for k, v in report.user_properties})
        if report.when == "call" or report.outcome != "passed":
            if row.outcome in ("not run", "passed"):
                row.outcome = "held" if report.outcome == "passed" else report.outcome
            if report.outcome == "failed":
                row.outcome = "FAILED"
                row.message = str(report.longrepr).strip().splitlines()[-1][:200] if report.longrepr else ""
            if report.outcome == "skipped":
                row.message = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def _cell(text: str, limit: int = 600) -> str:
    text = text.replace("|", "\\|").replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fault_table(rows: list[Row]) -> str:
    groups = {"tests/test_faults_store.py": "Store and network faults",
              "tests/test_faults_crash.py": "Crashes and disk",
              "tests/test_faults_load.py": "Load"}
    out = ["| # | scenario | what it asserts | injected | observed | outcome | s |", "|---|---|---|---|---|---|---|"]
    n = 0
    for file, title in groups.items():
        mine = [r for r in rows if r.file == file]
        if not mine:
            continue
        out.append(f"| | **{title}** (`{file}`) | | | | | |")
        previous = None
        for r in mine:
            n += 1
            doc = r.doc
            if doc and doc == previous:  # a parametrized scenario: say it once
                doc = "as above, with the parameters in the name"
            previous = r.doc
            observed = r.props.get("observed", "")
            if r.message:
                observed = f"{observed} {r.message}".strip()
            out.append(f"| {n} | `{_cell(r.name, 120)}` | {_cell(doc)} | {_cell(r.props.get('injected', ''))} | "
                       f"{_cell(observed)} | {r.outcome} | {r.seconds:.1f} |")
    return "\n".join(out)


def security_table(rows: list[Row], present: list[str]) -> str:
    if not present:
        return "_The security tests (tests/test_signing.py, tests/test_verify.py, tests/test_hostile_store.py) " \
               "did not exist when this report was generated._"
    out = ["| # | test | what it asserts | outcome | s |", "|---|---|---|---|---|"]
    n = 0
    for file in present:
        out.append(f"| | **`{file}`** | | | |")
        for r in (r for r in rows if r.file == file):
            n += 1
            doc = r.doc or "(no docstring; see the test)"
            if r.message:
                doc = f"{doc} — {r.message}"
            out.append(f"| {n} | `{_cell(r.name, 120)}` | {_cell(doc, 300)} | {r.outcome} | {r.seconds:.1f} |")
    return "\n".join(out)


def replace_section(text: str, key: str, body: str) -> str:
    begin, end = MARKERS[key]
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOC}: markers {begin} ... {end} not found")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="run and print the tables; do not touch the document")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    present = [f for f in SECURITY_FILES if (ROOT / f).exists()]
    files = FAULT_FILES + present
    collector = Collector()
    started = time.monotonic()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *[str(ROOT / f) for f in files],
                        *args.pytest_args], plugins=[collector])
    elapsed = time.monotonic() - started
    rows = [Row(r.nodeid.replace(str(ROOT) + "/", ""), r.doc, r.outcome, r.seconds, r.props, r.message)
            for r in collector.rows.values()]
    faults = [r for r in rows if r.file in FAULT_FILES]
    security = [r for r in rows if r.file in present]
    held = sum(r.outcome == "held" for r in rows)
    ran = [r for r in rows if r.outcome != "not run"]
    import moto
    import s3fs

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = (f"Generated by `scripts/reliability_report.py` on {stamp}: {len(ran)} scenarios run "
               f"({len(faults)} fault, {len(security)} security), {held} held, "
               f"{sum(r.outcome == 'FAILED' for r in rows)} failed, in {elapsed:.0f} s "
               f"(Python {sys.version.split()[0]}, moto {moto.__version__}, s3fs {s3fs.__version__}).")
    fault_body = summary + "\n\n" + fault_table(faults)
    security_body = security_table(security, present)
    if args.check:
        print(fault_body + "\n\n" + security_body)
    else:
        text = DOC.read_text()
        text = replace_section(text, "faults", fault_body)
        text = replace_section(text, "security", security_body)
        DOC.write_text(text)
        print(f"{DOC.relative_to(ROOT)}: {summary}")
    failed = code not in (0, pytest.ExitCode.NO_TESTS_COLLECTED) or any(r.outcome == "FAILED" for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
