"""Guest instructions per decoded (or prefilled) token of an ARM artifact under qemu: a
deterministic figure to compare ARM builds (schedules, kernels) where emulated wall time means
nothing.

    .venv/bin/python bench/arm_icount.py model.qwc [--prompt 16] [--steps 2 6]
    .venv/bin/python bench/arm_icount.py model.qwc --prefill 4 12

Runs the Engine under qemu-aarch64 (scripts/arm64/setup.sh) with bench/icount's plugin, one
thread, twice: prompt + a decode steps, prompt + b decode steps. (I_b - I_a) / (b - a) is the
cost of one decode step, start-up and prefill cancelled out. With --prefill A B the two runs
are prompts of A and B tokens and no decode: the cost of one prefilled token.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "arm64"))
import emulation  # noqa: E402  (scripts/arm64/emulation.py)


def count(env, plugin: str, artifact: str, steps: list) -> int:
    with tempfile.TemporaryDirectory() as d:
        cmd = emulation.engine_command(env, artifact, Path(d) / "out.npy", json.dumps(steps), plugin=plugin)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    m = re.search(r"qwc-icount: (\d+)", r.stderr)
    if r.returncode != 0 or not m:
        sys.exit(f"arm_icount: the emulated run failed: {r.stderr.strip().splitlines()[-1:]}")
    return int(m.group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, nargs=2, default=[2, 6])
    p.add_argument("--prefill", type=int, nargs=2, metavar=("A", "B"), help="count prefill instead: prompts of A and B tokens")
    args = p.parse_args()
    plugin = subprocess.run(["bash", str(REPO / "bench" / "icount" / "build.sh")], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    env = emulation.arm64_env(single_thread=True)
    env["PYTHONHASHSEED"] = "0"   # hash randomisation moved the count by up to 5% a token between runs
    if args.prefill:
        a, b = args.prefill
        ia = count(env, plugin, args.artifact, [list(range(100, 100 + a))])
        ib = count(env, plugin, args.artifact, [list(range(100, 100 + b))])
        print(f"{args.artifact}: {ia:,} instructions for a {a}-token prompt, {ib:,} for {b}: "
              f"{(ib - ia) / (b - a):,.0f} instructions per prefilled token")
        return
    prompt = list(range(100, 100 + args.prompt))
    a, b = args.steps
    ia = count(env, plugin, args.artifact, [prompt] + [5] * a)
    ib = count(env, plugin, args.artifact, [prompt] + [5] * b)
    print(f"{args.artifact}: {ia:,} instructions with {a} decode steps, {ib:,} with {b}: "
          f"{(ib - ia) / (b - a):,.0f} instructions per decoded token")


if __name__ == "__main__":
    main()
