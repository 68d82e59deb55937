"""What several commands share: option types (a bad value is one line `qwc: error: argument
--x: ...`, exit 2), option groups, and checks on what the user typed."""

from __future__ import annotations

import argparse
import math
import os
import sys

from qwc.cpu import max_threads
from qwc.errors import QwcError
from qwc.limits import DRAFT_MAX

# -- option types: a bad value is one line `qwc: error: argument --x: ...`, exit 2 ----------

def int_at_least(lo: int, what: str = ""):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be at least {lo}{what}")
        return v
    return parse


def int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        v = int_at_least(lo)(text)
        if v > hi:
            raise argparse.ArgumentTypeError(f"{v} is more than {hi}")
        return v
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"{text} is not in {lb}{lo:g}, {hi:g}{hb}")
        return v
    return parse


def thread_count(text: str) -> int:
    v = int_at_least(1)(text)
    cap = max_threads()
    if v > cap:
        raise argparse.ArgumentTypeError(f"{v} is more than {cap} (4 per CPU this process may use, at least 8)")
    return v


def template_variables(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of the chat template's own variables (Qwen3's
    enable_thinking), as llama-server's flag of that name takes them."""
    import json

    try:
        v = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON (e.g. '{{\"enable_thinking\": false}}')") from None
    if not isinstance(v, dict) or not all(isinstance(k, str) and k.isidentifier() for k in v):
        raise argparse.ArgumentTypeError("must be a JSON object of template variables (e.g. "
                                         "'{\"enable_thinking\": false}')")
    return {k: x for k, x in v.items() if k not in ("messages", "tools", "add_generation_prompt")}


def seed_value(text: str) -> int:
    v = int_at_least(-1)(text)
    if v >= 2**63:
        raise argparse.ArgumentTypeError(f"{v} does not fit 64 bits")
    return v


nonnegative = int_at_least(0)
positive = int_at_least(1)
NO_MEMORY_CHECK = ("run even when the stage's estimated peak memory exceeds what is available "
                    "(by default qwc refuses up front rather than be killed by the OOM killer)")



def check_utf8(text: str, what: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise QwcError(f"{what} is not valid UTF-8 text") from None


def speculation_options(p: argparse.ArgumentParser) -> None:
    """--speculate, --draft, --draft-max, --lookup-min (qwc run and qwc serve; _drafter reads them)."""
    p.add_argument("--speculate", choices=("off", "ngram"), default="off",
                   help="speculative decoding: 'ngram' drafts the tokens that followed the context's last n-gram "
                        "earlier in it (prompt lookup: replies that quote their prompt) and verifies a draft in one "
                        "call; sampled replies follow the same distribution as without it, greedy ones are the "
                        "same token for token on x86 (default off)")
    p.add_argument("--draft", metavar="SMALL.qwc",
                   help="speculative decoding with a draft model: a smaller artifact with the same tokenizer "
                        "(the 0.5B for a 7B, say) proposes tokens by greedy decoding, the model verifies "
                        "them in one call (instead of --speculate ngram)")
    p.add_argument("--draft-max", type=positive, default=DRAFT_MAX, metavar="N",
                   help=f"tokens a draft proposes at most (default {DRAFT_MAX}: a verify call of 8 tokens; "
                        "a draft after a miss is shorter)")
    p.add_argument("--lookup-min", type=positive, default=3, metavar="N",
                   help="the shortest n-gram of the context a draft is looked up by (default 3; from 4 down to it)")


def mmap_option(p: argparse.ArgumentParser) -> None:
    """--no-mmap (the commands that load an artifact: Engine's map_weights)."""
    p.add_argument("--no-mmap", action="store_true",
                   help="read the weights into this process's memory instead of mapping params.bin (as llama.cpp's "
                        "flag): a slower start, and no sharing of the pages with other processes that map it")


def poll_option(p: argparse.ArgumentParser) -> None:
    """--poll (the commands that run an artifact: Engine's poll)."""
    p.add_argument("--poll", type=int_in(0, 100), default=None, metavar="0-100",
                   help="how long idle worker threads poll for the next kernel before they sleep, as llama.cpp's "
                        "flag (default 50): 0 sleeps at once, which avoids stalls of hundreds of ms beside "
                        "other busy programs on the same cores, at a slower decode on a quiet machine")


def calibration_options(p: argparse.ArgumentParser, what: str, tokens: int) -> None:
    """--calib and --calib-tokens (eval/data.calibration_ids reads them)."""
    p.add_argument("--calib", default="austen:emma", metavar="TEXT",
                   help=f"calibration text{what}: a file or austen:<novel> (default austen:emma)")
    p.add_argument("--calib-tokens", type=int_at_least(512, " (one calibration window)"), default=tokens, metavar="N",
                   help=f"calibration tokens, in windows of 512 (default {tokens})")


def whole_tvm(command: str) -> None:
    """The compiler needs TVM's whole library. The runtime commands set TVM_USE_RUNTIME_LIB for
    themselves (TVM then loads its runtime alone); inherited by a compile, it made TVM fail
    deep inside with a traceback, so it goes, and a process that already loaded the runtime
    alone gets one line."""
    if "tvm" not in sys.modules:
        os.environ.pop("TVM_USE_RUNTIME_LIB", None)
        return
    import tvm

    if tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True) is None:
        raise QwcError(f"qwc {command} needs TVM's compiler, but this process loaded TVM's runtime alone "
                       "(TVM_USE_RUNTIME_LIB); run it in a new process")

