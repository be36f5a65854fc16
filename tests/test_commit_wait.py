"""The crash tests' wait before a kill (``megatron_ext.testing.commit_wait``) and the harness options that use it."""

from __future__ import annotations

import threading

import pytest

from megatron_ext.megatron.checkpoint_layout import TRACKER_FILE, write_tracker
from megatron_ext.testing import megatron_lm, reference_trainer
from megatron_ext.testing.commit_wait import await_tracker


def test_the_wait_ends_once_the_tracker_names_the_iteration_or_a_later_one(tmp_path, capsys):
    write_tracker(str(tmp_path), 1)
    later = threading.Timer(0.3, write_tracker, (str(tmp_path), 3))
    later.start()
    try:
        assert await_tracker(str(tmp_path / TRACKER_FILE), 2, int, timeout_s=30) == 3
    finally:
        later.join()
    assert f"{tmp_path / TRACKER_FILE} names 3 after" in capsys.readouterr().err


def test_a_tracker_caught_mid_write_is_read_again(tmp_path):
    (tmp_path / "latest").write_text("global_step")  # DeepSpeed's tag, half written
    later = threading.Timer(0.3, (tmp_path / "latest").write_text, ("global_step2",))
    later.start()
    try:
        assert await_tracker(str(tmp_path / "latest"), 2, lambda tag: int(tag.removeprefix("global_step")),
                             timeout_s=30) == 2
    finally:
        later.join()


def test_no_commit_in_time_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(SystemExit, match=f"no checkpoint of iteration 1 or later was committed within 0s "
                                         f"\\({tmp_path / TRACKER_FILE}: None\\)"):
        await_tracker(str(tmp_path / TRACKER_FILE), 1, int, timeout_s=0.2)


def test_the_harness_options_need_a_kill_and_a_save_directory(capsys):
    for argv in (["--committed-before-kill", "1", "--", "--save", "/x"],
                 ["--kill-at-iteration", "3", "--committed-before-kill", "1", "--"]):
        with pytest.raises(SystemExit):
            megatron_lm.main(argv)
        assert "--committed-before-kill needs --kill-at-iteration and a --save directory" in capsys.readouterr().err
    for argv in (["--committed-before-crash", "1", "--save", "/x"],
                 ["--crash-at-iteration", "3", "--committed-before-crash", "1"]):
        with pytest.raises(SystemExit):
            reference_trainer.main(argv)
        assert "--committed-before-crash needs --crash-at-iteration and --save" in capsys.readouterr().err
