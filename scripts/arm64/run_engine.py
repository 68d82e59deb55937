"""Runs under the emulated arm64 python (qemu-aarch64): qwc's runtime Engine on an artifact,
prefill then decode steps, logits saved to a .npy file. Only the runtime is importable there
(the aarch64 TVM wheel, numpy, tokenizers), so the qwc packages are loaded from the checkout.

    run_engine.py REPO ARTIFACT OUT.npy '[[prompt ids], next_id, next_id, ...]'
    run_engine.py REPO ARTIFACT OUT.npy '{"batch": [[prompt ids], ...], "tokens": N}'
    run_engine.py REPO ARTIFACT OUT.npy '{"prefill": [prompt ids], "repeat": N}'
    run_engine.py REPO ARTIFACT OUT.npy '{"steps": [[prompt ids], next_id, ...], "last": true}'
    run_engine.py REPO ARTIFACT OUT.npy '{"steps": [...], "fill": N, "last": true}'
    run_engine.py REPO ARTIFACT OUT.npy '{"mixed": [[prompt ids], ...], "chunk": N}'
    run_engine.py REPO ARTIFACT OUT.npy '{"lora": "ADAPTER.npz", "steps": [[prompt ids], next_id, ...]}'

Prints the machine, the number of logits rows and the threads TVM's pool ran kernels on.
The third prefills the prompt N times, each from an empty cache (bench/arm_threads.py: two
runs that differ by exactly one prefill call). The second form generates N greedy tokens for each prompt alone, then for all of them at once
through Engine.decode_many (rows of one pool), and saves both: logits [2, prompts, N, vocab].
With "last" (the first and third forms) only the last call's logits are kept and saved:
bench/arm_threads.py counts the main thread's instructions, and stacking every step's
logits at the end copied 600 KB more a step (78K instructions a 0.5B token) that are the
harness's, not the Engine's, and kept each step's output alive, so the VM's pool could not
reuse it. "fill": N positions of the cache count as filled (with zeros) before the steps, with
no prefill: decode steps then attend over N + the prompt's positions, as after an N-token
prompt, without emulating that prompt (bench/arm_icount.py --depth: its instructions would
cancel in the difference of two runs anyway, and take most of an hour at N = 4096). "mixed":
mixed_and_separate's two runs, logits [2, steps, prompts, vocab]. "lora": lora_runs' four runs
of the steps, logits [4, steps, vocab] (an artifact with adapter slots; the adapter's pairs in
an .npz, as save_adapter writes them: the guest has no peft or torch to read a PEFT directory).
"""

import importlib.util
import json
import os
import platform
import sys
from pathlib import Path


def _load_package(name: str, folder: Path) -> None:
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)


def main() -> None:
    repo, artifact, out, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    _load_package("qwc", repo / "qwc")
    _load_package("qwc.runtime", repo / "runtime")
    import numpy as np

    from qwc.runtime.engine import Engine

    last = isinstance(steps, dict) and steps.get("last", False)
    keep = (lambda kept, x: [x]) if last else (lambda kept, x: kept + [x])
    # Emulated guest threads (TVM_NUM_THREADS) may be many more than the host's cores.
    if isinstance(steps, dict) and "repeat" in steps:   # the same prefill, from an empty cache each time
        eng = Engine(artifact, ctx=max(64, len(steps["prefill"])), oversubscribe=True)
        logits = []
        for _ in range(steps["repeat"]):
            eng.reset()
            logits = keep(logits, eng.prefill(steps["prefill"]))
    elif isinstance(steps, dict) and "mixed" in steps:
        eng = Engine(artifact, ctx=max(64, max(map(len, steps["mixed"])) + 16), oversubscribe=True)
        modes = {"mixed": (True,), "separate": (False,)}.get(steps.get("mode"), (True, False))
        logits = mixed_and_separate(eng, steps["mixed"], steps["chunk"], modes, last)
    elif isinstance(steps, dict) and "verify" in steps:   # decode steps, and one verify call of their tokens
        prompt, new = steps["verify"], steps["tokens"]
        eng = Engine(artifact, ctx=len(prompt) + len(new) + 16, oversubscribe=True)
        logits = list(decode_and_verify(eng, prompt, new))
    elif isinstance(steps, dict) and "lora" in steps:
        eng = Engine(artifact, ctx=64, oversubscribe=True)
        _load_package("qwc.models", repo / "models")
        logits = lora_runs(eng, steps["lora"], steps["steps"])
    elif isinstance(steps, dict) and "batch" in steps:
        eng = Engine(artifact, ctx=64, oversubscribe=True)
        logits = greedy_alone_and_batched(eng, steps["batch"], steps["tokens"])
    else:
        fill = steps.get("fill", 0) if isinstance(steps, dict) else 0
        steps = steps["steps"] if isinstance(steps, dict) else steps
        eng = Engine(artifact, ctx=max(64, fill + len(steps[0]) + len(steps)), oversubscribe=True)   # room for a long prompt
        eng.seq.pos = fill
        logits = [eng.prefill(steps[0])]
        for t in steps[1:]:
            logits = keep(logits, eng.decode(t))
    np.save(out, np.stack(logits))
    if os.environ.get("QWC_DUMP_MAPS"):   # where each library was mapped, for bench/arm_icount.py's attribution
        Path(os.environ["QWC_DUMP_MAPS"]).write_text(Path("/proc/self/maps").read_text())
    print(platform.machine(), len(logits), eng.threads_in_use())


def save_adapter(ad, path) -> None:
    """A adapter_files.Adapter's pairs into an .npz that lora_runs reads."""
    import numpy as np

    arrays = {}
    for i, (name, p) in enumerate(sorted(ad.pairs.items())):
        arrays[f"{i}.a"], arrays[f"{i}.b"] = p.a, p.b
        arrays[f"{i}.meta"] = np.array([name, repr(p.scale)])
    np.savez(path, kind=np.array(ad.kind), **arrays)


def lora_runs(eng, npz, steps):
    """The steps (a prompt, then tokens one at a time) with the adapter of `npz` in slot 1:
    on the base alone, on the adapter alone, then both at once (decode_many's rows of one pool:
    the base's and the adapter's); logits [4, steps, vocab]."""
    import numpy as np

    from qwc.adapter_files import Adapter, LoraPair

    f = np.load(npz)
    ad = Adapter(str(npz), str(f["kind"]))
    i = 0
    while f"{i}.a" in f:
        name, scale = f[f"{i}.meta"]
        ad.pairs[str(name)] = LoraPair(f[f"{i}.a"], f[f"{i}.b"], float(scale))
        i += 1
    eng.load_adapters([("a", ad)])
    out = []
    for slot in (0, 1):
        eng.reset()
        eng.seq.adapter = slot
        out.append([eng.prefill(steps[0]).copy()] + [eng.decode(t).copy() for t in steps[1:]])
    seqs = list(eng.pool(2).seqs)
    rows = [[], []]
    for s, slot in zip(seqs, (0, 1)):
        s.adapter = slot
        rows[slot].append(eng.prefill(steps[0], s).copy())
    for t in steps[1:]:
        for slot, lg in enumerate(eng.decode_many([t, t], seqs)):
            rows[slot].append(lg.copy())
    return [np.array(x) for x in out + rows]


def decode_and_verify(eng, prompt, new):
    """`prompt` in two sequences, then `new` decoded a token a step in one and verified in one
    call in the other: (the decode steps' logits, the verify call's), which must be equal to the
    bit (compiler/kernels/decode_attention.py: `queries`)."""
    import numpy as np

    one, many = eng.sequence(), eng.sequence()
    eng.prefill(prompt, one)
    eng.prefill(prompt, many)
    return np.stack([eng.decode(t, one).copy() for t in new]), eng.verify(new, many)


def greedy_alone_and_batched(eng, prompts, n):
    import numpy as np

    alone = []
    for p in prompts:
        seq = eng.sequence()
        lg, steps = eng.prefill(p, seq), []
        for _ in range(n):
            steps.append(lg.copy())
            lg = eng.decode(int(lg.argmax()), seq)
        alone.append(steps)
    seqs = eng.pool(len(prompts)).seqs
    cur = [eng.prefill(p, s).copy() for p, s in zip(prompts, seqs)]
    batched = [[] for _ in prompts]
    for _ in range(n):
        for b, lg in enumerate(cur):
            batched[b].append(lg)
        cur = [x.copy() for x in eng.decode_many([int(lg.argmax()) for lg in cur], seqs)]
    return [np.array(alone), np.array(batched)]


def mixed_and_separate(eng, prompts, chunk, modes=(True, False), last=False):
    """All prompts but the last prefilled, then steps that each decode those greedily and take
    the next `chunk` tokens of the last prompt: in one Engine.step call (mixed), and as
    decode_many then prefill (separate), on rows of a pool each. Every step's logits, the
    last prompt's its chunk's last: [len(modes), steps, prompts, vocab] (`last`: the last
    step's only, bench/arm_threads.py: the harness's copies are not the engine's work)."""
    import numpy as np

    *running, tail = prompts
    runs = []
    for mixed in modes:
        seqs = eng.pool(len(prompts)).seqs
        cur = [eng.prefill(p, s).copy() for p, s in zip(running, seqs)]
        steps = []
        for at in range(0, len(tail), chunk):
            toks, part = [int(lg.argmax()) for lg in cur], tail[at:at + chunk]
            if mixed:
                out = eng.step([(s, [t]) for s, t in zip(seqs, toks)] + [(seqs[len(running)], part)])
            else:
                out = [*eng.decode_many(toks, seqs[:len(running)]), eng.prefill(part, seqs[len(running)])]
            steps = [out] if last else steps + [[x.copy() for x in out]]
            cur = out[:-1]
        runs.append([[x.copy() for x in out] for out in steps])
    return np.array(runs)


if __name__ == "__main__":
    main()
