"""Progress output: bars only where someone watches them."""

from __future__ import annotations

from qwc import progress


def test_bars_draw_only_on_a_terminal(capsys):
    """A piped `qwc eval` or `qwc qat` must not write hundreds of redrawn frames into a log."""
    progress.set_quiet(False)
    try:
        bar = progress.bar(range(50), desc="frames")   # pytest's captured stderr is no terminal
        for _ in bar:
            bar.set_postfix(x=1)
        assert bar.disable
        assert "\r" not in capsys.readouterr().err
    finally:
        progress.set_quiet(True)
