"""How a stage process starts: its allocator (grpo_pipeline/allocator.py: what each GRPO_ALLOCATOR asks for,
and that a stage script really re-executes itself once with it, before torch is imported), and its
deterministic mode set without importing torch._dynamo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_pipeline import allocator

ROOT = Path(__file__).resolve().parent.parent
LIB = "/opt/lib/libtcmalloc_minimal.so.4"


def test_auto_prefers_tcmalloc_and_keeps_a_users_preload():
    changes, what = allocator.environment({}, tcmalloc=LIB)
    assert changes["LD_PRELOAD"] == LIB and "tcmalloc" in what
    assert int(changes["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) > 2**31   # no stderr line per big tensor
    changes, _ = allocator.environment({"LD_PRELOAD": "/x/libfoo.so"}, tcmalloc=LIB)
    assert changes["LD_PRELOAD"].split() == [LIB, "/x/libfoo.so"]
    assert allocator.environment({"LD_PRELOAD": f"{LIB} /x/libfoo.so"}, tcmalloc=LIB) == ({}, f"tcmalloc ({LIB})")


def test_auto_without_tcmalloc_tunes_glibc_without_overriding_the_user(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    changes, what = allocator.environment({})
    assert what == "glibc, tuned" and set(changes) == {"GLIBC_TUNABLES"}
    got = dict(kv.split("=") for kv in changes["GLIBC_TUNABLES"].split(":"))
    assert got == allocator.GLIBC and int(got["glibc.malloc.mmap_threshold"]) >= 2**30
    mine = "glibc.malloc.trim_threshold=1:glibc.malloc.arena_max=2"
    got = allocator.environment({"GLIBC_TUNABLES": mine})[0]["GLIBC_TUNABLES"].split(":")
    assert got[:2] == mine.split(":") and "glibc.malloc.trim_threshold=17179869184" not in got
    # already applied: nothing to change, so no re-exec
    assert allocator.environment({"GLIBC_TUNABLES": changes["GLIBC_TUNABLES"]}) == ({}, "glibc, tuned")


def test_explicit_choices_and_errors(monkeypatch):
    assert allocator.environment({allocator.ENV: "system"}) == ({}, "system allocator")
    changes, _ = allocator.environment({allocator.ENV: "glibc"}, tcmalloc=None)
    assert "LD_PRELOAD" not in changes and "GLIBC_TUNABLES" in changes
    with pytest.raises(ValueError, match="GRPO_ALLOCATOR='jemaloc'"):
        allocator.environment({allocator.ENV: "jemaloc"})
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    with pytest.raises(ValueError, match="libtcmalloc-minimal4"):
        allocator.environment({allocator.ENV: "tcmalloc"})


def test_find_tcmalloc_looks_in_the_given_dirs(tmp_path):
    assert allocator.find_tcmalloc((str(tmp_path),)) in (None, allocator.find_tcmalloc(()))
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc_minimal.so.4")


PROBE = """
import json, os, sys
sys.path.insert(0, {stages!r})
import _common  # noqa: F401  (re-executes this script once with the allocator)
print(json.dumps({{"argv": sys.argv[1:], "torch_loaded": "torch" in sys.modules, "mark": os.environ.get({mark!r}),
                  "tunables": os.environ.get("GLIBC_TUNABLES", ""), "preload": os.environ.get("LD_PRELOAD", ""),
                  "maps": open("/proc/self/maps").read().count("tcmalloc") > 0}}))
"""


def _probe(tmp_path: Path, **env: str) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(stages=str(ROOT / "stages"), mark=allocator.MARK))
    base = {k: v for k, v in os.environ.items() if k not in (allocator.ENV, allocator.MARK, "GLIBC_TUNABLES")}
    r = subprocess.run([sys.executable, str(script), "--flag", "a b"], env={**base, **env}, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout      # the first image printed nothing: it was replaced, not forked
    return json.loads(lines[0])


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD / GLIBC_TUNABLES are Linux's")
def test_a_stage_script_reexecutes_itself_with_the_allocator(tmp_path):
    got = _probe(tmp_path, **{allocator.ENV: "glibc"})
    assert got["mark"] == "1" and got["argv"] == ["--flag", "a b"] and not got["torch_loaded"]
    assert "glibc.malloc.mmap_threshold=4294967296" in got["tunables"]
    got = _probe(tmp_path, **{allocator.ENV: "system"})
    assert got["mark"] is None and "mmap_threshold" not in got["tunables"]
    if allocator.find_tcmalloc():     # installed by .ci/install where apt-get runs as root
        got = _probe(tmp_path, **{allocator.ENV: "tcmalloc"})
        assert got["mark"] == "1" and got["maps"], got   # the library is really mapped into the process
    bad = subprocess.run([sys.executable, str(ROOT / "stages" / "check.py")], env={**os.environ,
                         allocator.ENV: "jemaloc"}, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1 and "error: GRPO_ALLOCATOR='jemaloc'" in bad.stderr


def test_deterministic_sets_torchs_and_inductors_flags_without_importing_dynamo(tmp_path):
    """``run.deterministic`` (update, SFT): deterministic kernels on, warn-only, and inductor's flag too (read
    from TORCHINDUCTOR_DETERMINISTIC when inductor is imported later), in a process that never loads dynamo."""
    code = ("import sys, torch; sys.path.insert(0, {root!r}); from grpo_pipeline.run import deterministic; "
            "deterministic(); dyn = 'torch._dynamo' in sys.modules; import torch._inductor.config as c; "
            "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(), "
            "c.deterministic, dyn)").format(root=str(ROOT))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True", "False"]


RELEASE = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from grpo_pipeline.allocator import release_free_memory
anon = lambda: int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) // 1024
x = torch.ones(512 << 18)      # 512 MiB of float32, touched
del x
before = anon()
name = release_free_memory()
print(json.dumps({{"name": name, "before": before, "after": anon()}}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RssAnon, LD_PRELOAD are Linux's")
@pytest.mark.parametrize("choice", ["tcmalloc", "glibc"])
def test_release_free_memory_returns_a_freed_block_the_allocator_kept(tmp_path, choice):
    lib = allocator.find_tcmalloc()
    if choice == "tcmalloc" and lib is None:
        pytest.skip("tcmalloc is not installed (.ci/install installs it where apt-get runs as root)")
    changes, _ = allocator.environment({allocator.ENV: choice}, tcmalloc=lib if choice == "tcmalloc" else None)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    script = tmp_path / "release.py"
    script.write_text(RELEASE.format(root=str(ROOT)))
    r = subprocess.run([sys.executable, str(script)], env={**base, **changes}, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["name"] == choice
    # both keep the freed 512 MiB in the process (tcmalloc's page heap; glibc tuned: heap, no trim) ...
    assert got["before"] >= 400, got
    assert got["before"] - got["after"] >= 400, got      # ... until asked to give it back
