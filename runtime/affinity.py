"""Which replica of `qwc serve --replicas` takes a request (runtime/replicas.py), and the
replicas' metrics as one page. Pure code: the Ray request router (affinity_router.py) calls it.

A request goes where its prompt's beginning went before, so that replica's slots may still hold
it in their caches (the scheduler's prefix reuse): the key is the chat's system prompt, or the
first KEY_CHARS characters of the prompt (rendered chat messages, or a completion's text or
token ids). A key seen before has a home, the replica that took it last; a new key, or one
whose home is busy (IMBALANCE more requests in flight than the least loaded replica) or gone,
goes to the least loaded replica, which becomes its home. So load balances where there is
nothing to reuse, as the vLLM router and Ray's PrefixCacheAffinityRouter fall back.
"""

from __future__ import annotations

import json
from collections import OrderedDict

KEY_CHARS = 256      # a prompt's beginning that names its home replica
IMBALANCE = 4        # requests in flight past the least loaded replica's before affinity gives way
HOMES = 100_000      # keys remembered (least recently used go first)


class Homes:
    """key -> the replica that took it last, the HOMES most recently used keys."""

    def __init__(self, size: int = HOMES):
        self.size, self._homes = size, OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None or key not in self._homes:
            return None
        self._homes.move_to_end(key)
        return self._homes[key]

    def set(self, key: str | None, replica: str) -> None:
        if key is None:
            return
        self._homes[key] = replica
        self._homes.move_to_end(key)
        while len(self._homes) > self.size:
            self._homes.popitem(last=False)


def prefix_key(path: str, body: bytes) -> str | None:
    """The affinity key of an OpenAI request body (None: no prompt to keep together, e.g. a
    malformed body, which any replica refuses alike)."""
    if not path.endswith(("/completions", "/chat/completions")):
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    messages = req.get("messages")
    if isinstance(messages, list):
        system = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")]
        if system:
            return "system:" + json.dumps(system, sort_keys=True)
        text = "".join(f"{m.get('role')}:{json.dumps(m.get('content'))}\n" for m in messages if isinstance(m, dict))
        return "chat:" + text[:KEY_CHARS]
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # one prompt in a batch of one
    if isinstance(prompt, str):
        return "text:" + prompt[:KEY_CHARS]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "ids:" + ",".join(map(str, prompt[:KEY_CHARS // 4]))
    return None


def rank(home: str | None, replicas: list[str], in_flight: dict[str, int | None],
         imbalance: int = IMBALANCE) -> list[list[str]]:
    """Ranks of replica ids, most preferred first (the router tries a rank's replicas by queue
    length, and the next rank where none takes it): the key's home alone, then the others;
    without a live home, or with one `imbalance` requests busier than the least loaded replica
    (`in_flight`: None where unknown, counted as 0), all of them least loaded first."""
    if not replicas:
        return []
    load = {r: in_flight.get(r) or 0 for r in replicas}
    by_load = sorted(replicas, key=lambda r: (load[r], r))
    if home not in load or load[home] - load[by_load[0]] >= imbalance:
        return [by_load]
    return [[home], [r for r in by_load if r != home]] if len(replicas) > 1 else [[home]]


def merge_metrics(pages: list[tuple[str, str]]) -> str:
    """One Prometheus page from (replica label, page) pairs: each sample gains a `replica`
    label, each family's HELP and TYPE appear once."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString  # the library's own sample format

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, page in pages:
        for fam in text_string_to_metric_families(page):
            _, _, lines = families.setdefault(fam.name, (fam.documentation, fam.type, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": replica}
                inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                lines.append(f"{s.name}{{{inner}}} {floatToGoString(s.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        head = f"{name}_total" if kind == "counter" else name   # as prometheus-client writes a counter
        out += [f"# HELP {head} {doc}", f"# TYPE {head} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
