"""The random-weight demo checkpoint (`qctl up` and `qctl demo` without --model) appears whole or not at all."""

from __future__ import annotations

import pytest

from shared.model import demo
from shared.model.demo import write_demo_checkpoint


def test_a_write_stopped_midway_leaves_no_folder(tmp_path, monkeypatch):
    """It was written in place, config.json before the tokenizer: a Ctrl-C (or a kill) while the tokenizer was
    trained left a folder every later `qctl up` took for the model, and failed to load."""

    def interrupted(folder, vocab):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "train_demo_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_demo_checkpoint(tmp_path / "demo-model", "tiny")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling


def test_a_whole_write_is_complete(tmp_path):
    from shared.model.demo import demo_checkpoint_complete

    folder = write_demo_checkpoint(tmp_path / "demo-model", "tiny")
    assert folder == tmp_path / "demo-model" and demo_checkpoint_complete(folder)
    assert [p.name for p in tmp_path.iterdir()] == ["demo-model"]
    (folder / "tokenizer_config.json").unlink()  # what an older version stopped midway left
    assert not demo_checkpoint_complete(folder)
