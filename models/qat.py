"""Quantization-aware training with fake quantization that is exactly Q4_0.

Forward passes use fq(W), the weight a Q4_0 round trip gives (qwc/q4.py's arithmetic, in torch,
bit for bit); gradients pass straight through to the float weight (straight-through
estimator). The saved checkpoint holds fq(W) itself, so `qwc optimize` on it is lossless.

Training starts by folding each RMSNorm gain into the linears that read it and keeps the
folded gains at exactly 1: the quantized weight trained here is the one the passes quantize,
with or without `qwc optimize --fold-norm-gains` (which skips all-ones gains). The final norm keeps a trainable gain, as the
tied lm_head cannot absorb it.

With a teacher (`--teacher`, by default the float model being trained) the loss mixes cross
entropy on the text with knowledge distillation: (1 - w) CE + w T^2 KL(teacher_T || student_T) on
the logits at temperature T. The teacher's logits are computed on the fly (one no-grad forward a
step, ~1/4 of a training step's work), not cached: a cache of full-vocabulary logits would be
tens of GB for a few hundred steps.

Checkpoints (model, optimizer, step) go to OUT_DIR.ckpt/ every `save_every` steps; a rerun of
the same command resumes from it. Batches are a function of (seed, step), so a resumed run sees
the same data as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qwc import progress
from qwc.atomic import check_destination
from qwc.errors import QwcError
from qwc.text import read_text

from .qwen2 import LoadedModel


def fake_quantize_q4_0(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """qwc.q4.fake_quantize_q4_0 in torch: float32 steps in the same order, so equal bit for bit."""
    n, k = w.shape
    x = w.float()
    pad = -k % block
    if pad:
        x = F.pad(x, (0, pad))
    x = x.reshape(n, -1, block)
    idx = x.abs().argmax(dim=2, keepdim=True)          # first of equal magnitudes, as numpy
    m = torch.gather(x, 2, idx)
    d = m / -8.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.clamp(torch.trunc(x * inv + 8.5), max=15.0)
    d16 = d.half().float()
    return ((q - 8.0) * d16).reshape(n, -1)[:, :k].to(w.dtype)


class _STE(torch.autograd.Function):
    """fq(w) forward, identity backward."""

    @staticmethod
    def forward(ctx, w, block):
        return fake_quantize_q4_0(w, block)

    @staticmethod
    def backward(ctx, g):
        return g, None


def ste_q4_0(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _STE.apply(w, block)


class FakeQuant:
    """Fake quantization of a set of modules' weights: `weights()` maps each parameter name to
    fq(W) for torch.func.functional_call, which also applies it to weights tied to it (the
    tied lm_head reads the quantized embedding)."""

    def __init__(self, modules: dict[str, nn.Module], block: int):
        self.modules, self.block = modules, block

    def weights(self) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": ste_q4_0(m.weight, self.block) for name, m in self.modules.items()}

    def snap(self) -> None:
        """Replace each float weight by fq(W): the model now sits on the Q4_0 grid."""
        with torch.no_grad():
            for m in self.modules.values():
                m.weight.copy_(fake_quantize_q4_0(m.weight, self.block))


def fold_norm_gains(model) -> None:
    """W <- W diag(g), g <- 1 (frozen) for the norms whose readers are all linears."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, readers in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                           layer.self_attn.v_proj)),
                                  (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj))):
                for lin in readers:
                    lin.weight.mul_(norm.weight[None, :])
                norm.weight.fill_(1.0)
                norm.weight.requires_grad_(False)


def quantized_modules(model, embedding: bool) -> dict[str, nn.Module]:
    mods = {name: m for name, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)}
    mods = {f"model.layers.{k}": v for k, v in mods.items()}
    if embedding:
        mods["model.embed_tokens"] = model.model.embed_tokens
        if not model.config.tie_word_embeddings:
            mods["lm_head"] = model.lm_head
    return mods


@dataclass
class QatSettings:
    steps: int
    lr: float = 2e-5
    seq_len: int = 256
    batch: int = 4
    group_size: int = 32
    quantize_embedding: bool = False
    fake_quant_after: int | None = None   # None: after a tenth of the steps
    warmup: int = 10                      # linear learning-rate warm-up steps
    save_every: int = 50
    seed: int = 0
    teacher: str | None = None            # a model spec; None: no distillation
    kd_weight: float = 0.5                # loss = (1 - w) CE + w KD
    kd_temperature: float = 1.0
    bf16: bool = False                    # bf16 autocast for the matmuls (for CPUs with AVX512-BF16 / AMX)

    def validate(self) -> None:
        if self.steps < 1:
            raise QwcError("--steps must be at least 1")
        if self.group_size != 32:
            raise QwcError(f"--group-size {self.group_size}: only 32 (Q4_0) is supported")
        if self.seq_len < 2 or self.batch < 1:
            raise QwcError("--seq-len must be at least 2 and --batch at least 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QwcError(f"--lr {self.lr}: must be a positive finite number")
        if self.save_every < 1:
            raise QwcError(f"--save-every {self.save_every}: must be at least 1")
        if self.fake_quant_after is not None and not 0 <= self.fake_quant_after <= self.steps:
            raise QwcError(f"--fake-quant-after {self.fake_quant_after}: must be between 0 and --steps")
        if not 0 <= self.kd_weight <= 1:
            raise QwcError(f"--kd-weight {self.kd_weight}: must be between 0 and 1")
        if not (self.kd_temperature > 0 and math.isfinite(self.kd_temperature)):
            raise QwcError(f"--kd-temperature {self.kd_temperature}: must be a positive finite number")

    @property
    def fq_start(self) -> int:
        return self.steps // 10 if self.fake_quant_after is None else self.fake_quant_after


def _batch(tokens: np.ndarray, s: QatSettings, step: int) -> torch.Tensor:
    rng = np.random.default_rng([s.seed, step])
    starts = rng.integers(0, len(tokens) - s.seq_len - 1, size=s.batch)
    return torch.from_numpy(np.stack([tokens[a:a + s.seq_len + 1] for a in starts]).astype(np.int64))


def _fingerprint(source: str, data: bytes, s: QatSettings) -> str:
    h = hashlib.sha256(json.dumps({"source": str(source), "settings": asdict(s)}, sort_keys=True).encode())
    h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def _lr_at(step: int, s: QatSettings) -> float:
    return s.lr * min(1.0, (step + 1) / max(1, s.warmup))


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), averaged over tokens (Hinton et al.:
    T^2 keeps the gradient's size independent of T)."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature ** 2


def load_teacher(lm: LoadedModel, source: str, spec: str):
    """The teacher model in eval mode: a float copy of the student when `spec` is its own source,
    else the model `spec` names, which must share the student's tokenizer."""
    if spec == source:
        teacher = copy.deepcopy(lm.model)
    else:
        from .load import load_source

        other = load_source(spec)
        if other.tokenizer.get_vocab() != lm.tokenizer.get_vocab() or other.config.vocab_size != lm.config.vocab_size:
            raise QwcError(f"--teacher {spec}: its tokenizer differs from {source}'s; distillation needs the same one")
        teacher = other.model
    teacher.config._attn_implementation = "sdpa"
    teacher.eval().requires_grad_(False)
    return teacher


def read_corpus(paths: list[Path], tokenizer, seq_len: int) -> tuple[np.ndarray, bytes]:
    """The training token ids of one or more texts (each tokenized alone, then concatenated) and
    a digest of the texts (for the run's fingerprint)."""
    ids, raw = [], b""
    for p in paths:
        text = read_text(p)
        raw += hashlib.sha256(text.encode("utf-8")).digest()
        ids.append(np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64))
    tokens = np.concatenate(ids)
    if len(tokens) < seq_len + 2:
        raise QwcError(f"{', '.join(map(str, paths))}: {len(tokens)} tokens, fewer than one sequence of {seq_len}")
    return tokens, raw


def train(lm: LoadedModel, source: str, data_paths: list[Path], settings: QatSettings, out_dir: Path,
          threads: int | None = None) -> dict:
    """Fine-tune `lm` with Q4_0 fake quantization and write a HF Qwen2 directory to `out_dir`."""
    settings.validate()
    out_dir = Path(out_dir)
    check_destination(out_dir, folder=True, foreign=foreign_files)
    tokens, raw = read_corpus(data_paths, lm.tokenizer, settings.seq_len)
    if threads:
        torch.set_num_threads(threads)

    model = lm.model
    teacher = None if settings.teacher is None else load_teacher(lm, source, settings.teacher)
    model.config._attn_implementation = "sdpa"  # training speed; export uses eager again
    # --fake-quant-after equal to --steps: fake quantization never runs and this is a float
    # fine-tune (bench/accuracy.py's control), kept as such: the gains stay in the norms and the
    # weights off the grid (folding and snapping would make it a post-training quantization,
    # with the fold's cost).
    quantizing = settings.fq_start < settings.steps
    if quantizing:
        fold_norm_gains(model)
    fq = FakeQuant(quantized_modules(model, settings.quantize_embedding), settings.group_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)

    ckpt_dir = out_dir.with_name(out_dir.name + ".ckpt")
    if ckpt_dir.exists() and (not ckpt_dir.is_dir() or any(p.name not in CKPT_FILES for p in ckpt_dir.iterdir())):
        raise QwcError(f"cannot use {ckpt_dir} for checkpoints: it holds files qwc qat did not write "
                       "(remove it or choose another output)")
    fingerprint = _fingerprint(source, raw, settings)
    step, losses = 0, []
    state_file = ckpt_dir / "state.pt"
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        if state.get("fingerprint") != fingerprint:
            raise QwcError(f"{ckpt_dir} holds a run with other settings or data; remove it to start afresh")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
        progress.info(f"[qwc] resuming from step {step} ({ckpt_dir})")

    def save_checkpoint():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_dir / "state.pt.tmp"
        torch.save({"fingerprint": fingerprint, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "step": step, "losses": losses}, tmp)
        os.replace(tmp, state_file)

    model.train()
    t0 = time.perf_counter()
    first = step
    bar = progress.bar(total=settings.steps, desc="qat", unit="step")
    bar.update(step)
    while step < settings.steps:
        fq_on = step >= settings.fq_start
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, settings)
        x = _batch(tokens, settings, step)
        subs = fq.weights() if fq_on else {}   # fq(W) in float32: exact whatever the matmuls' precision
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            logits = torch.func.functional_call(model, subs, (x[:, :-1],)).logits
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        if teacher is not None:
            kd = distillation_loss(logits, t_logits, settings.kd_temperature)
            loss = (1 - settings.kd_weight) * loss + settings.kd_weight * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise QwcError(f"loss became {losses[-1]} at step {step}; lower --lr")
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", fq="on" if fq_on else "off")
        if step % settings.save_every == 0 and step < settings.steps:
            save_checkpoint()
    bar.close()
    elapsed = time.perf_counter() - t0

    if quantizing:
        fq.snap()
    model.eval()
    model.config._attn_implementation = "eager"
    _save_hf(lm, out_dir, {"source": str(source), "data": [str(p) for p in data_paths], "settings": asdict(settings),
                           "final_loss": float(np.mean(losses[-10:])), "losses": losses})
    for name in CKPT_FILES:   # only what save_checkpoint wrote: never a user's file
        (ckpt_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        ckpt_dir.rmdir()
    return {"steps": settings.steps, "trained_steps": settings.steps - first, "seconds": elapsed,
            "first_loss": losses[0], "final_loss": float(np.mean(losses[-10:]))}


QAT_MARKER = "qwc_qat.json"
CKPT_FILES = ("state.pt", "state.pt.tmp")


def foreign_files(folder: Path) -> str | None:
    """What in an existing `folder` is not a QAT output qwc wrote (None: nothing)."""
    from .hf import foreign_hf_files

    return foreign_hf_files(folder, QAT_MARKER, "qwc qat")


def _save_hf(lm: LoadedModel, out_dir: Path, record: dict) -> None:
    from .hf import save_hf_dir

    save_hf_dir(lm, out_dir, QAT_MARKER, record, "qwc qat")
