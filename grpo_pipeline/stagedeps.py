"""The code each DVC stage runs, derived from its imports, so ``dvc.yaml``'s ``deps`` cannot drift.

A stage's code is the closure of its script (``stages/<name>.py``, the ``python <script>`` of its
``cmd``) under imports, found statically (:mod:`ast`): every ``import`` / ``from ... import``
anywhere in a file (function-local ones included) that names a module of this checkout — a
``grpo_pipeline`` module, or a sibling of the script such as ``stages/_common.py`` — together
with the ``__init__.py`` of every package on the way, and any sibling ``.py`` file a module names
in a string literal (a file it runs as a subprocess, e.g. ``sandbox.py`` starting
``sandbox_supervisor.py``).  Modules loaded by a name given at run time (``reward.custom``'s
``module:function``) are user code, outside the checkout's stages.

The rule checked by :func:`check` (and ``tests/test_stage_deps.py``): the code files among a
stage's ``deps`` (paths under ``stages/`` or ``grpo_pipeline/``; a directory stands for the
``.py`` files under it) are exactly the closure — every module the stage imports is a dep, and no
module it does not import is one, so editing an unrelated module does not rerun it.

    grpo-pipeline deps            # print each stage's code deps, as dvc.yaml should list them
    grpo-pipeline deps --check    # exit 1 naming every stage whose deps differ
    grpo-pipeline deps --write    # rewrite the code deps in dvc.yaml (other deps and comments kept)
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import yaml

__all__ = ["CODE_ROOTS", "check", "code_deps", "import_closure", "rewrite", "stage_scripts"]

CODE_ROOTS = ("grpo_pipeline", "stages")


def _module_file(root: Path, dotted: str) -> Path | None:
    """``a.b.c`` -> ``root/a/b/c.py`` or ``root/a/b/c/__init__.py`` when it exists."""
    base = root.joinpath(*dotted.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _with_packages(root: Path, dotted: str) -> list[Path]:
    """The module's file and the ``__init__.py`` of each package above it (Python runs them all)."""
    parts = dotted.split(".")
    files = [_module_file(root, ".".join(parts[: k + 1])) for k in range(len(parts))]
    return [f for f in files if f is not None]


def _package_of(root: Path, file: Path) -> list[str]:
    rel = file.relative_to(root).with_suffix("").parts
    return list(rel[:-1])   # a module's package, or an __init__'s own


def _imports(root: Path, file: Path) -> set[Path]:
    """Files of this checkout that ``file`` imports or runs (see the module doc)."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    found: set[Path] = set()
    here = file.parent

    def absolute(dotted: str) -> None:
        top = dotted.split(".")[0]
        if top in CODE_ROOTS[:1]:
            found.update(_with_packages(root, dotted))
        elif here == root / CODE_ROOTS[1] and (here / f"{top}.py").is_file():  # a stage script's sibling
            found.add(here / f"{top}.py")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                absolute(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(root, file)
                pkg = pkg[: len(pkg) - node.level + 1]
                dotted = ".".join(pkg + ([node.module] if node.module else []))
                found.update(_with_packages(root, dotted))
            elif node.module:
                dotted = node.module
                absolute(dotted)
            else:
                continue
            for alias in node.names:  # `from pkg import submodule`
                sub = _module_file(root, f"{dotted}.{alias.name}")
                if sub is not None and dotted.split(".")[0] == CODE_ROOTS[0]:
                    found.add(sub)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"\w+\.py", node.value) and (here / node.value).is_file()):
            found.add(here / node.value)
    return found


def import_closure(script: str | Path, root: str | Path = ".") -> list[str]:
    """Sorted repo-relative paths of ``script`` and every checkout file it imports, transitively."""
    root = Path(root).resolve()
    start = (root / script).resolve()
    seen, todo = {start}, [start]
    while todo:
        for f in _imports(root, todo.pop()):
            f = f.resolve()
            if f not in seen:
                seen.add(f)
                todo.append(f)
    return sorted(p.relative_to(root).as_posix() for p in seen)


def stage_scripts(dvc_yaml: str | Path = "dvc.yaml") -> dict[str, tuple[str, list[str]]]:
    """``{stage: (script, deps as written)}`` for every stage (a ``foreach`` stage once, by its name)."""
    stages = yaml.safe_load(Path(dvc_yaml).read_text(encoding="utf-8"))["stages"]
    out = {}
    for name, st in stages.items():
        body = st.get("do", st)
        words = shlex.split(body["cmd"])
        scripts = [w for w in words if w.endswith(".py")]
        if not scripts:
            msg = f"{dvc_yaml}: stage {name!r} runs no python script ({body['cmd']!r})"
            raise ValueError(msg)
        out[name] = (scripts[0], [str(d) for d in body.get("deps", [])])
    return out


def code_deps(deps: list[str], root: Path) -> set[str]:
    """The code files a ``deps`` list covers (a directory under a code root stands for its ``.py`` files)."""
    files: set[str] = set()
    for d in deps:
        if d.split("/")[0] not in CODE_ROOTS:
            continue
        p = root / d
        if p.is_dir():
            files.update(q.relative_to(root).as_posix() for q in p.rglob("*.py"))
        else:
            files.add(d)
    return files


def check(dvc_yaml: str | Path = "dvc.yaml") -> dict[str, tuple[list[str], list[str]]]:
    """``{stage: (missing, extra)}`` for each stage whose code deps differ from its import closure."""
    root = Path(dvc_yaml).resolve().parent
    bad = {}
    for name, (script, deps) in stage_scripts(dvc_yaml).items():
        want = set(import_closure(script, root))
        have = code_deps(deps, root)
        if want != have:
            bad[name] = (sorted(want - have), sorted(have - want))
    return bad


def rewrite(dvc_yaml: str | Path = "dvc.yaml") -> None:
    """Replace each stage's code deps in ``dvc_yaml`` by its import closure, as a block list after
    its other deps; other lines (comments included) are kept as they are."""
    path = Path(dvc_yaml)
    root = path.resolve().parent
    scripts = stage_scripts(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[str] = []
    stage, i = None, 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"^  ([\w-]+):\s*$", line):
            stage = m.group(1)
        d = re.match(r"^(\s+)deps:(.*)$", line)
        if not (d and stage in scripts):
            out.append(line)
            i += 1
            continue
        ind, rest = d.group(1), d.group(2).strip()
        i += 1
        while rest.count("[") > rest.count("]"):  # a flow list over several lines
            rest += " " + lines[i].strip()
            i += 1
        while not rest and i < len(lines) and re.match(rf"^{ind}  - ", lines[i]):
            i += 1
        script, deps = scripts[stage]
        keep = [x for x in deps if x.split("/")[0] not in CODE_ROOTS]
        out.append(f"{ind}deps:")
        out += [f"{ind}  - {x}" for x in keep + import_closure(script, root)]
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


def main(dvc_yaml: str = "dvc.yaml", *, check_only: bool = False, write: bool = False) -> int:
    root = Path(dvc_yaml).resolve().parent
    if write:
        rewrite(dvc_yaml)
        check_only = True
    if check_only:
        bad = check(dvc_yaml)
        for name, (missing, extra) in bad.items():
            print(f"{dvc_yaml}: stage {name!r}: deps miss {missing}, list modules it does not import {extra}")
        if not bad:
            print(f"{dvc_yaml}: every stage's code deps equal its import closure")
        return 1 if bad else 0
    for name, (script, _) in stage_scripts(dvc_yaml).items():
        print(f"{name}:")
        for f in import_closure(script, root):
            print(f"  - {f}")
    return 0
