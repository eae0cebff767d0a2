"""The runtime (codec, relay, the commands that operate a run) never imports the lab, and the lab
uses only the public API of codec and relay.

The lab is codec.lab and relay.lab: the bench's baselines and entropy bound, the corpus generator,
the demo and the bench. A rollout host installs the runtime; these tests keep it from growing a
dependency on code (and packages) that only the demo extra brings.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("codec", "relay")
LAB = ("codec.lab", "relay.lab")
# Drop-ins for trainers (relay.integrations.trl, .verl): they import their trainer's packages, which a rollout host
# and a plain trainer never install, so the runtime never imports them.
INTEGRATIONS = ("relay.integrations",)
TRAINER_PACKAGES = ("transformers", "trl", "accelerate", "datasets", "verl", "ray")
# What the lab may import from the runtime: the packages' top level (their __all__) and the
# modules their docstrings declare public. Names with a leading underscore are never public.
PUBLIC = {"codec", "codec.tensors", "codec.compressors", "codec.wire",
          "relay", "relay.checkpoint", "relay.traffic"}


def is_lab(module: str) -> bool:
    return any(module == lab or module.startswith(lab + ".") for lab in LAB)


def is_integration(module: str) -> bool:
    return any(module == i or module.startswith(i + ".") for i in INTEGRATIONS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


MODULES = source_modules()


def is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def imports(name: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import in the file, at any depth (functions too),
    relative ones resolved; `from m import n` yields (m, n), and (m.n, None) as well when m.n is
    one of our modules. importlib.import_module / __import__ with a literal count as imports."""
    package = name if is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    found.append((node.lineno, sub, None))
                else:
                    found.append((node.lineno, target, a.name))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if called in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value, None))
    return found


def test_the_walk_sees_the_layout():
    assert {"codec.api", "relay.cli", "relay.watcher", "codec.lab.baselines", "codec.lab.bound", "relay.lab.demo",
            "relay.lab.bench", "relay.lab.corpus", "relay.lab.commands"} <= set(MODULES)
    # the checker itself finds what it must: a relative import of the lab, inside a function
    tree = imports("relay.lab.demo", MODULES["relay.lab.demo"])
    assert any(m == "relay.lab.corpus" for _, m, _ in tree)


def test_no_runtime_module_imports_the_lab():
    bad = [f"{name} ({path.relative_to(ROOT)}:{line}) imports {mod}{f'.{n}' if n else ''}"
           for name, path in MODULES.items() if not is_lab(name)
           for line, mod, n in imports(name, path)
           if is_lab(mod) or (n and is_lab(f"{mod}.{n}"))]
    assert not bad, "the runtime must not import the lab:\n" + "\n".join(bad)


def test_the_lab_uses_only_the_public_api():
    bad = []
    for name, path in MODULES.items():
        if not is_lab(name):
            continue
        for line, mod, n in imports(name, path):
            if mod.split(".")[0] not in PACKAGES or is_lab(mod):
                continue
            where = f"{name} ({path.relative_to(ROOT)}:{line})"
            if mod not in PUBLIC:
                bad.append(f"{where} imports the internal module {mod}")
            elif n and n.startswith("_"):
                bad.append(f"{where} imports the private {mod}.{n}")
        bound = {a.asname or a.name for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names
                 if (getattr(node, "module", None) or a.name).split(".")[0] in PACKAGES}
        for node in ast.walk(ast.parse(path.read_text())):  # codec._x, tensors._y, ...
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{name} ({path.relative_to(ROOT)}:{node.lineno}) uses the private "
                           f"{node.value.id}.{node.attr}")
    assert not bad, "the lab must use only the public API (or a documented public function):\n" + "\n".join(bad)


def _loaded_lab(code: str) -> list[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith(('codec.lab', " \
                   "'relay.lab')))))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_runtime_loads_no_lab_module():
    runtime = sorted(n for n in MODULES if not is_lab(n) and not is_integration(n))
    assert _loaded_lab("import codec, relay, relay.cli\n" + "".join(f"import {n}\n" for n in runtime)) == []


def test_no_runtime_module_imports_an_integration_or_a_trainer_package():
    bad = [f"{name} ({path.relative_to(ROOT)}:{line}) imports {mod}"
           for name, path in MODULES.items() if not is_lab(name) and not is_integration(name)
           for line, mod, n in imports(name, path)
           if is_integration(mod) or mod.split(".")[0] in TRAINER_PACKAGES]
    assert not bad, "the runtime must not import relay.integrations or a trainer's packages:\n" + "\n".join(bad)
    runtime = sorted(n for n in MODULES if not is_lab(n) and not is_integration(n))
    probe = ("import json, sys\nimport codec, relay, relay.cli\n" + "".join(f"import {n}\n" for n in runtime)
             + f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {TRAINER_PACKAGES!r})))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_runtime_commands_load_no_lab_module():
    commands = ["publish", "watch", "relay", "status", "rebase", "gc", "encode", "decode", "inspect", "keygen",
                "verify"]
    # `deltarelay -v watch ...`: the command is the first word that is not an option
    code = "from relay import cli\n" + "".join(f"cli.build_parser(cli._command_of(['-v', {c!r}, 'x']))\n"
                                              for c in commands)
    assert _loaded_lab(code) == []


def test_help_loads_only_the_lab_command_table():
    """`deltarelay --help` loads the lab's command module (light: parsers) and nothing heavier."""
    loaded = _loaded_lab("from relay import cli\ncli.build_parser()\n")
    assert set(loaded) <= {"relay.lab", "relay.lab.commands"}, loaded
