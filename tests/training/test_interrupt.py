"""Ctrl-C during training: ``scripts/pretrain_gpt.py`` ends with exit code 130 and one line from rank 0,
not a KeyboardInterrupt traceback from every rank."""

from __future__ import annotations

import pytest

from .preflight_harness import SCRIPT, _env


def _interrupted(_args):
    raise KeyboardInterrupt


@pytest.mark.parametrize("rank, lines", [("0", ["pretrain_gpt.py: interrupted"]), ("1", [])])
def test_interrupt_is_exit_130_and_one_line_from_rank_0(rank, lines, monkeypatch, capsys):
    import lagom_megatron.training.loop as loop

    monkeypatch.setattr(loop, "pretrain", _interrupted)
    _env(monkeypatch, {"RANK": rank, "WORLD_SIZE": "4"})
    capsys.readouterr()
    try:
        code = SCRIPT.main(["--preset", "cpu-tp2-dp2", "--mock-data"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt left pretrain_gpt.py's main (a traceback on every rank)")
    assert code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == lines, err
