"""Runs under the emulated arm64 python (qemu-aarch64): qwc's CLI as an ARM machine runs it,
for the commands that need only the runtime (`run`, `bench`, `targets`, and `eval` of an
artifact: perplexity of an ARM build, as bench/act_scale.py's --arm rows run it). The qwc packages are loaded from
the checkout, as in run_engine.py.

    run_cli.py REPO bench model.qwc --threads 4 ...
"""

import sys
from pathlib import Path

from run_engine import _load_package


def main() -> int:
    repo = Path(sys.argv[1])
    _load_package("qwc", repo / "qwc")
    _load_package("qwc.runtime", repo / "runtime")
    _load_package("qwc.eval", repo / "eval")
    _load_package("qwc.compiler", repo / "compiler")   # its target table only (`qwc targets`)
    from qwc.cli import main as cli

    return cli(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
