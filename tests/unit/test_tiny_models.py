"""`connector.tiny_models.build_model`: the models the engine tests and the fuzz run."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector import tiny_models


def test_a_process_that_loses_the_race_to_build_the_same_model_takes_the_winners(tmp_path, monkeypatch):
    """Two engine processes (the fuzz's kvscope and baseline) build the same model at once: the one
    renaming second found the folder taken and failed (engine fuzz seed 4085, in a fresh checkout).
    It now takes the other's model and removes its own copy."""
    built = Path(tiny_models.build_model("llama", cache_dir=tmp_path))
    original_rename = Path.rename

    def the_other_process_renames_first(self, target):
        assert Path(target) == built and not built.exists()
        original_rename(built.with_name(built.name + ".winner"), built)  # the other process's copy
        return original_rename(self, target)

    original_rename(built, built.with_name(built.name + ".winner"))
    monkeypatch.setattr(Path, "rename", the_other_process_renames_first)
    assert tiny_models.build_model("llama", cache_dir=tmp_path) == str(built)
    assert (built / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.name]  # no temporary copy left


def test_a_rename_that_fails_for_another_reason_still_fails(tmp_path, monkeypatch):
    def read_only(self, target):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(Path, "rename", read_only)
    with pytest.raises(PermissionError):
        tiny_models.build_model("llama", cache_dir=tmp_path)
