"""Reading R's lazy-load data databases (`data/Rdata.rdx` + `data/Rdata.rdb`) without R.

The .rdx index is a gzip'd serialization of list(variables = list(name = c(offset, length)),
references, compressed). Each variable's record in the .rdb at [offset, offset + length) is a
4-byte big-endian uncompressed length followed by a zlib stream (compressed = TRUE; 2 and 3
add a type byte for bzip2 / xz) of the variable serialized in R's XDR format ("X\\n").

Only what data packages hold is decoded: vectors, lists, pairlists, symbols, attributes,
references, and the two ALTREP classes R writes for plain vectors (wrappers, compact sequences).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

NA_INTEGER = -(2**31)

# SEXP types (R Internals, "Serialization formats")
_NIL, _SYM, _LIST, _CLO, _ENV, _PROM, _LANG = 0, 1, 2, 3, 4, 5, 6
_CHAR, _LGL, _INT, _REAL, _CPLX, _STR, _DOT, _VEC, _EXPR, _RAW = 9, 10, 13, 14, 15, 16, 17, 19, 20, 24
_S4 = 25
_ALTREP, _ATTRLIST, _ATTRLANG = 238, 239, 240
_BASEENV, _EMPTYENV, _GLOBALENV, _UNBOUND, _MISSING, _BASENS = 241, 242, 253, 252, 251, 250
_NAMESPACE, _PACKAGE, _PERSIST, _NILVALUE, _REF = 249, 248, 247, 254, 255


class RDataError(ValueError):
    pass


class RList(list):
    """A decoded R list / pairlist: elements in order, `names` when the object has them."""

    def __init__(self, items=(), names=None, attrs=None):
        super().__init__(items)
        self.names = names
        self.attrs = attrs or {}

    def as_dict(self) -> dict:
        if self.names is None:
            raise RDataError("list has no names")
        return dict(zip(self.names, self))


class _Reader:
    def __init__(self, data: bytes):
        self.d = data
        self.p = 0
        self.refs: list = []

    def _take(self, n: int) -> bytes:
        if self.p + n > len(self.d):
            raise RDataError("truncated serialization")
        b = self.d[self.p:self.p + n]
        self.p += n
        return b

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def header(self) -> None:
        fmt = self._take(2)
        if fmt != b"X\n":
            raise RDataError(f"not an XDR serialization (format {fmt!r})")
        version = self.int()
        self.int(), self.int()  # writer and minimal reader R versions
        if version == 3:
            self._take(self.int())  # native encoding name
        elif version != 2:
            raise RDataError(f"unsupported serialization version {version}")

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == _NILVALUE:
            return None
        if t in (_GLOBALENV, _BASEENV, _EMPTYENV, _BASENS, _UNBOUND, _MISSING):
            return None
        if t == _REF:
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if t in (_PERSIST, _PACKAGE, _NAMESPACE):
            if self.int() != 0:
                raise RDataError("bad persistent name")
            names = [self.item() for _ in range(self.int())]
            self.refs.append(names)
            return names
        if t == _SYM:
            name = self.item()
            self.refs.append(name)
            return _Symbol(name)
        if t == _ENV:
            self.int()  # locked
            env: dict = {}
            self.refs.append(env)
            self.item(), self.item(), self.item(), self.item()  # enclosure, frame, hash table, attributes
            return env
        if t in (_LIST, _LANG, _CLO, _PROM, _DOT, _ATTRLIST, _ATTRLANG):
            return self._pairlist(has_attr, has_tag)
        if t == _CHAR:
            n = self.int()
            return None if n == -1 else self._take(n).decode("utf-8", errors="replace")
        if t in (_LGL, _INT):
            n = self.length()
            v = list(struct.unpack(f">{n}i", self._take(4 * n)))
        elif t == _REAL:
            n = self.length()
            v = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif t == _CPLX:
            n = self.length()
            r = struct.unpack(f">{2 * n}d", self._take(16 * n))
            v = [complex(r[2 * i], r[2 * i + 1]) for i in range(n)]
        elif t == _STR:
            v = [self.item() for _ in range(self.length())]
        elif t in (_VEC, _EXPR):
            v = RList(self.item() for _ in range(self.length()))
        elif t == _RAW:
            v = self._take(self.length())
        elif t == _ALTREP:
            info, state, attr = self.item(), self.item(), self.item()
            v = _altrep(info, state)
            return _with_attrs(v, attr)
        elif t == _S4:
            v = None
        else:
            raise RDataError(f"unsupported R object type {t}")
        if has_attr:
            v = _with_attrs(v, self.item())
        return v

    def _pairlist(self, has_attr: bool, has_tag: bool) -> RList:
        items, names = [], []
        attrs = None
        while True:
            if has_attr:
                attrs = self.item()
            tag = self.item() if has_tag else None
            items.append(self.item())
            names.append(str(tag) if tag is not None else "")
            flags = self.int()
            t = flags & 0xFF
            if t == _NILVALUE:
                break
            if t not in (_LIST, _LANG, _ATTRLIST, _ATTRLANG):
                self.p -= 4  # a non-pairlist tail (never in data); read it as one more element
                items.append(self.item())
                names.append("")
                break
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        out = RList(items, names if any(names) else None)
        if attrs is not None:
            out = _with_attrs(out, attrs)
        return out


class _Symbol(str):
    pass


def _with_attrs(v, attrs):
    if attrs is None:
        return v
    ad = attrs.as_dict() if isinstance(attrs, RList) and attrs.names else {}
    if not isinstance(v, RList):
        v = RList(v if v is not None else [])
    v.attrs.update(ad)
    if "names" in ad:
        v.names = list(ad["names"])
    return v


def _altrep(info, state):
    cls = str(info[0]) if isinstance(info, list) and info else "?"
    if cls.startswith("wrap_"):
        return state[0]  # list(payload, metadata)
    if cls == "compact_intseq":
        n, start, step = (int(x) for x in state)
        return list(range(start, start + n * step, step))
    if cls == "compact_realseq":
        n, start, step = state
        return [start + i * step for i in range(int(n))]
    raise RDataError(f"unsupported ALTREP class {cls}")


def unserialize(data: bytes):
    r = _Reader(data)
    r.header()
    return r.item()


def _decompress_record(rec: bytes, compressed: int) -> bytes:
    if len(rec) < 4:
        raise RDataError("truncated record")
    size = struct.unpack(">I", rec[:4])[0]
    body = rec[4:]
    if compressed in (2, 3):
        kind, body = body[:1], body[1:]
        if kind == b"Z":
            out = lzma.decompress(body) if compressed == 3 else bz2.decompress(body)
        elif kind == b"2":
            out = bz2.decompress(body)
        elif kind == b"0":
            out = body
        else:
            out = zlib.decompress(body)
    else:
        out = zlib.decompress(body)
    if len(out) != size:
        raise RDataError(f"record decompressed to {len(out)} bytes, header says {size}")
    return out


def read_lazyload_db(base: Path) -> dict:
    """All variables of the lazy-load database `base`.rdx / `base`.rdb, by name."""
    base = Path(base)
    rdx, rdb = base.with_suffix(".rdx"), base.with_suffix(".rdb")
    try:
        index = unserialize(gzip.decompress(rdx.read_bytes())).as_dict()
        blob = rdb.read_bytes()
    except (OSError, EOFError, zlib.error, RDataError) as e:
        raise RDataError(f"{base}: unreadable lazy-load database ({e})") from None
    compressed = index.get("compressed", [1])
    compressed = int(compressed[0]) if compressed else 1
    out = {}
    for name, (offset, length) in index["variables"].as_dict().items():
        rec = blob[offset:offset + length]
        out[name] = unserialize(_decompress_record(rec, compressed))
    return out
