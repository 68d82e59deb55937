"""What `qwc serve` runs, built from its options (an argparse namespace or the same fields):
the engine, the scheduler and the HTTP app. `qwc serve` and each replica of `qwc serve
--replicas` (replicas.py) build the same; `qwc run` shares the drafting options."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from qwc import progress
from qwc.errors import QwcError


def check_draft_options(args) -> None:
    if args.draft and args.speculate == "ngram":
        raise QwcError("--draft and --speculate ngram are two ways of drafting: give one")


def drafter(args, eng):
    """The drafter factory --speculate / --draft ask for (None: no speculation)."""
    from .engine import Engine

    if args.speculate == "ngram":
        from .speculate import NgramDrafter

        return functools.partial(NgramDrafter, args.draft_max, ngram_min=args.lookup_min)
    if args.draft:
        from .speculate import DraftModel

        try:
            small = Engine(args.draft, ctx=eng.ctx, threads=eng.threads, map_weights=not getattr(args, "no_mmap", False))
        except QwcError as e:
            raise QwcError(f"--draft: {e}") from None
        return DraftModel(small, eng, args.draft_max)
    return None


def named_adapters(specs: list[str], base: str) -> list[tuple[str, str]]:
    """`--lora NAME=PATH[:SCALE]` options -> (NAME, PATH[:SCALE]); a name is what a request's
    `model` field gives, so it must differ from the base's and from the other adapters'."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path:
            raise QwcError(f"--lora {spec}: expected NAME=PATH (the name requests give as their model)")
        if name == base:
            raise QwcError(f"--lora {spec}: {name!r} is the base model's name")
        out.append((name, path))
    return out


def adapters(args, eng, base: str) -> None:
    """Load `qwc serve --lora` adapters into the engine's slots (no option: none)."""
    specs = getattr(args, "lora", None) or []
    if not specs:
        if getattr(args, "max_lora_rank", None):
            raise QwcError("--max-lora-rank bounds the adapters of --lora: give --lora NAME=PATH")
        return
    from .adapters import load_adapters

    eng.load_adapters(load_adapters(named_adapters(specs, base), eng.model), args.max_lora_rank)


def serve_needs() -> None:
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "prometheus_client")):
        raise QwcError("qwc serve needs the serve extra: pip install 'qwc[serve]'")
    if "tvm" not in sys.modules:
        os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")


def chosen_context(args, sequences: int, cap: int | None = None) -> tuple[int, str | None]:
    """(--ctx, None), or where it is not given the model's own context (runtime/context_size.py)
    and the line that says so, printed once the rest has started (an option's error first)."""
    if args.ctx is not None:
        return args.ctx, None
    from qwc.manifest import read_manifest

    from .context_size import default_context

    ctx, why = default_context(read_manifest(Path(args.model)), sequences, cap)
    return ctx, f"[qwc] context: {ctx} tokens a sequence ({why}; --ctx sets it)"


def server_parts(args):
    """What `qwc serve` runs, from its options: (engine, scheduler not yet started, the FastAPI
    app, the model's name). A replica of `qwc serve --replicas` builds the same
    (runtime/replicas.py)."""
    from .engine import Engine
    from .scheduler import Scheduler
    from .server import Settings, create_app
    from .spec_policy import speculation_warning

    serve_needs()
    check_draft_options(args)
    ctx, said = chosen_context(args, sequences=args.max_batch)
    eng = Engine(args.model, ctx=ctx, threads=args.threads, map_weights=not args.no_mmap,
                 poll=getattr(args, "poll", None))
    name = args.model_name or Path(args.model).resolve().name.removesuffix(".qwc")
    adapters(args, eng, name)
    drafts = drafter(args, eng)
    if warning := speculation_warning(eng, drafts):
        print(f"qwc: warning: {warning}", file=sys.stderr, flush=True)
    if said:
        progress.info(said)
    sched = Scheduler(eng, max_running=args.max_batch, max_queue=args.max_queue, min_reuse=args.reuse_prefix or None,
                      speculate=drafts, spec_batch=args.spec_batch, mixed_steps=not args.no_mixed_steps)
    return eng, sched, create_app(eng, sched, Settings(model_id=name, api_key=args.api_key,
                                                  reasoning_format=args.reasoning_format,
                                                  template_variables=args.chat_template_kwargs,
                                                  webui=not args.no_webui, pooling=args.pooling)), name
