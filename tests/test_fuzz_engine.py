"""Fuzzing engine folders (hypothesis): a damaged or hostile manifest, tokenizer, chat template,
n-gram table or device profile makes loading and generating either work or raise a
DSparkError, and nothing outside the folder is opened (a canary file beside it, reached
through links and paths the mutations plant, must stay unread)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dspark_edge
from dspark_edge.errors import DSparkError
from dspark_edge.manifest import file_entry

FILES = ("manifest.json", "tokenizer.json", "chat_template.jinja", "ngram_table.npz", "profile",
         "target/fp32/embed_tokens.npy")

_opened: list[str] = []
_watching = [False]


def _audit(event, args):
    if _watching[0] and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; it records only while _watching


@pytest.fixture(scope="module")
def table_bytes(tiny_engine, tmp_path_factory):
    """A real n-gram table for the tiny engine, to be damaged."""
    from dspark_export.ngram_table import build_table

    from tiny_model import fake_answer_work

    seqs = [(list(range(10, 20)), list(range(20, 40))), (list(range(40, 45)), list(range(20, 35)))]
    work = fake_answer_work(tmp_path_factory.mktemp("ngram-work") / "work", seqs)
    out = tmp_path_factory.mktemp("ngram") / "t.npz"
    build_table(tiny_engine, work, output=out, progress=lambda *_: None, calibrate=False)
    return out.read_bytes()


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("replace"), st.binary(max_size=300)),
    st.tuples(st.just("link_out"), st.none()),
    st.tuples(st.just("json_edit"), st.sampled_from(["deep", "bigint", "template_path", "file_path", "negative",
                                                      "wrong_type", "huge_size"])),
)


def _mutate(engine: Path, name: str, how, canary: Path, profiles: Path) -> Path:
    path = profiles / "device.json" if name == "profile" else engine / name
    kind, arg = how
    data = path.read_bytes() if path.is_file() else b""
    if kind == "truncate":
        path.write_bytes(data[:int(len(data) * arg)])
    elif kind == "flip" and data:
        buf = bytearray(data)
        for at, value in arg:
            buf[min(int(at * len(buf)), len(buf) - 1)] = value
        path.write_bytes(bytes(buf))
    elif kind == "replace":
        path.write_bytes(arg)
    elif kind == "link_out":
        path.unlink(missing_ok=True)
        path.symlink_to(canary)
    elif kind == "json_edit":
        m = json.loads((engine / "manifest.json").read_text())
        if arg == "deep":
            (engine / "manifest.json").write_text("[" * 20000 + "]" * 20000)
            return path
        if arg == "bigint":
            m["model"]["vocab_size"] = int("9" * 4000) if sys.get_int_max_str_digits() == 0 else 10**300
        elif arg == "template_path":
            m["tokenizer"]["chat_template_file"] = os.path.relpath(canary, engine)
            m["files"].append({"path": os.path.relpath(canary, engine), "sha256": "0" * 64, "size": 1})
        elif arg == "file_path":
            m["files"][0]["path"] = str(canary)
        elif arg == "negative":
            m["model"]["num_layers"] = -3
        elif arg == "wrong_type":
            m["tokenizer"]["eos_ids"] = "2"
        elif arg == "huge_size":
            m["files"][0]["size"] = 10**15
        (engine / "manifest.json").write_text(json.dumps(m))
    return path


def _rehash(engine: Path, name: str) -> None:
    """Record a mutated listed file's new size and hash, so the parser behind the check runs."""
    try:
        m = json.loads((engine / "manifest.json").read_text())
        entry = file_entry(engine, name)
    except (OSError, ValueError):
        return
    for f in m.get("files", []):
        if f.get("path") == name:
            f["sha256"], f["size"] = entry.sha256, entry.size
    (engine / "manifest.json").write_text(json.dumps(m))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(FILES), how=mutation, rehash=st.booleans(), chat=st.booleans())
def test_a_damaged_engine_folder_works_or_raises_a_dspark_error(tiny_engine, table_bytes, tmp_path, monkeypatch,
                                                                 name, how, rehash, chat):
    case = tmp_path / f"case-{os.urandom(4).hex()}"
    engine = case / "engine"
    shutil.copytree(tiny_engine, engine)
    (engine / "ngram_table.npz").write_bytes(table_bytes)
    canary = case / "canary.txt"
    canary.write_text("{{ 'CANARY' }} secret outside the engine folder")
    profiles = case / "profiles"
    profiles.mkdir()
    from dspark_edge.profile import device_identity

    (profiles / "device.json").write_text("{}")
    monkeypatch.setenv("DSPARK_PROFILES", str(profiles))
    _mutate(engine, name, how, canary, profiles)
    if name == "profile":
        os.replace(profiles / "device.json", profiles / f"{device_identity()[0]}.json") \
            if (profiles / "device.json").exists() or (profiles / "device.json").is_symlink() else None
    elif rehash and how[0] in ("truncate", "flip", "replace") and name != "manifest.json":
        _rehash(engine, name)
    _opened.clear()
    _watching[0] = True
    try:
        with dspark_edge.load(engine, "fp32", drafter="auto") as pipe:
            prompt = [{"role": "user", "content": "hi"}] if chat else "The quick brown"
            r = pipe.generate(prompt, max_new_tokens=4)
            assert "CANARY" not in r.text
    except DSparkError:
        pass
    finally:
        _watching[0] = False
    real_canary = str(canary.resolve())
    assert not [p for p in _opened if os.path.realpath(p) == real_canary], _opened
    outside = [p for p in _opened if str(Path(p).resolve()).startswith(str(case.resolve()))
               and not str(Path(p).resolve()).startswith(str(engine.resolve()))
               and not str(Path(p).resolve()).startswith(str(profiles.resolve()))]
    assert not outside, outside
