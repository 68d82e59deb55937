"""`qwc lora`: train a LoRA or QA-LoRA adapter on CPU and write it as a PEFT directory.

- LoRA: peft's own `get_peft_model` on the float model; the base is frozen and only A and B
  train. The output is what `save_pretrained` writes, so transformers + peft load it unchanged.
- QA-LoRA (`--qa`): every linear of the base is its 4-bit blocks (models/lora_merge.py's
  `qa_base_blocks`: the GGUF's own Q4_0 / Q4_1, or qwc's Q4_0 of a float weight), frozen and
  dequantized, and each adapted one adds s·B·A·pool(x), pool being peft's QA-LoRA pooling (the
  mean of each block of 32 inputs times the number of blocks). peft implements that variant only
  for GPTQ layers, so the layer is here, and the adapter is saved in peft's format with
  `use_qalora` and `qalora_group_size = 32`. `qwc export --lora` merges it exactly into Q4_1.

Checkpoints (the adapter's weights, the optimizer, the step) go to OUT.ckpt/ every
`save_every` steps; `--resume` continues one. Batches are a function of (seed, step), so a
resumed run sees the data an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qwc import progress
from qwc.adapter_files import BLOCK_OF, LINEARS, MARKER, PEFT_CONFIG, PEFT_WEIGHTS, QA_GROUP, linear_shapes
from qwc.atomic import check_destination, replace_dir, staging_dir
from qwc.errors import QwcError

from .checkpoint import Checkpoint
from .qwen2 import LoadedModel

CKPT_FILES = ("state.pt", "state.pt.tmp")


@dataclass
class LoraSettings:
    steps: int
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = LINEARS
    lr: float = 2e-4
    seq_len: int = 256
    batch: int = 4
    warmup: int = 10
    save_every: int = 50
    seed: int = 0
    qa: bool = False

    def validate(self) -> None:
        if self.steps < 1:
            raise QwcError("--steps must be at least 1")
        if self.rank < 1:
            raise QwcError(f"--rank {self.rank}: must be at least 1")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise QwcError(f"--alpha {self.alpha}: must be a positive finite number")
        bad = [t for t in self.targets if t not in LINEARS]
        if bad or not self.targets:
            raise QwcError(f"--target {','.join(bad) or '(none)'}: a Qwen2 model's linears are {', '.join(LINEARS)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise QwcError(f"--lr {self.lr}: must be a positive finite number")
        if self.seq_len < 2 or self.batch < 1:
            raise QwcError("--seq-len must be at least 2 and --batch at least 1")
        if self.save_every < 1:
            raise QwcError(f"--save-every {self.save_every}: must be at least 1")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class QALoraLinear(nn.Module):
    """A frozen 4-bit linear (dequantized) plus s·B·A·pool(x), peft's QA-LoRA arithmetic."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rank: int, scaling: float):
        super().__init__()
        out, k = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.blocks, self.scaling = k // QA_GROUP, scaling
        self.lora_A = nn.Parameter(torch.empty(rank, self.blocks))
        self.lora_B = nn.Parameter(torch.zeros(out, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))   # peft's initialisation: B = 0, so step 0 is the base

    def forward(self, x):
        pooled = x.unflatten(-1, (self.blocks, QA_GROUP)).mean(-1) * self.blocks
        return F.linear(x, self.weight, self.bias) + (pooled @ self.lora_A.T @ self.lora_B.T) * self.scaling


def _linears(model):
    """(HF module path, its parent module, its attribute name) of every linear."""
    for i, layer in enumerate(model.model.layers):
        for name in LINEARS:
            yield f"model.layers.{i}.{BLOCK_OF[name]}.{name}", getattr(layer, BLOCK_OF[name]), name


def attach_qalora(model, ckpt: Checkpoint, s: LoraSettings) -> dict[str, QALoraLinear]:
    """Every linear set to its 4-bit base; the targeted ones replaced by QA-LoRA layers."""
    from .gguf_blocks import dequantize
    from .lora_merge import qa_base_blocks

    for name, (_, k) in linear_shapes(ckpt.config).items():
        if k % QA_GROUP:
            raise QwcError(f"{ckpt.source}: {name} has {k} inputs, not whole blocks of {QA_GROUP}; QA-LoRA needs them")
    layers = {}
    bar = progress.bar(total=7 * model.config.num_hidden_layers, desc="4-bit base", unit="linear")
    for path, parent, name in _linears(model):
        old = getattr(parent, name)
        w = torch.from_numpy(dequantize(qa_base_blocks(ckpt, path + ".weight")))
        bias = None if old.bias is None else old.bias.detach().clone()
        if name in s.targets:
            new = QALoraLinear(w, bias, s.rank, s.scaling)
            layers[path] = new
            setattr(parent, name, new)
        else:
            with torch.no_grad():
                old.weight.copy_(w)
        bar.update(1)
    bar.close()
    model.requires_grad_(False)
    for m in layers.values():
        m.lora_A.requires_grad_(True)
        m.lora_B.requires_grad_(True)
    return layers


def attach_lora(model, source: str, s: LoraSettings):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=s.rank, lora_alpha=s.alpha, target_modules=list(s.targets), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(source))
    model.name_or_path = str(source)   # what peft records as the base (it reads the model's)
    return get_peft_model(model, cfg)


def train_memory(cfg, s: LoraSettings) -> int:
    """Estimated peak bytes: the float32 model (and its 4-bit copy's dequantized weights for
    QA-LoRA, which replace it), each layer's saved activations for the backward pass, the logits
    with their float copy, log-softmax and gradients, and the interpreter (docs/history/README.md, "Adapters":
    measured against it on SmolLM2)."""
    h, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    params = v * h * (1 if cfg.tie_word_embeddings else 2) + L * (4 * h * h + 3 * h * i)
    tokens = s.batch * s.seq_len
    acts = tokens * L * (16 * h + 6 * i + 2 * cfg.num_attention_heads * s.seq_len)
    return 4 * params + 4 * acts + 5 * 4 * tokens * v + 2**30


def _windows(tokens: np.ndarray, mask: np.ndarray, s: LoraSettings, step: int):
    rng = np.random.default_rng([s.seed, step])
    starts = rng.integers(0, len(tokens) - s.seq_len - 1, size=s.batch)
    x = np.stack([tokens[a:a + s.seq_len + 1] for a in starts])
    m = np.stack([mask[a + 1:a + s.seq_len + 1] for a in starts])
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(m)


def _fingerprint(source: str, data: bytes, s: LoraSettings) -> str:
    h = hashlib.sha256(json.dumps({"source": str(source), "settings": asdict(s)}, sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


def foreign_files(folder: Path) -> str | None:
    """What in an existing `folder` qwc lora did not write (None: nothing)."""
    if not folder.exists():
        return None
    if not (folder / MARKER).is_file():
        return f"it is not an adapter qwc lora wrote (no {MARKER})"
    ours = {PEFT_CONFIG, PEFT_WEIGHTS, "README.md", MARKER}
    extra = sorted(p.name for p in folder.iterdir() if p.name not in ours)
    return f"it holds {extra[0]}, which qwc lora did not write" if extra else None


class _Run:
    """One training run's state: what it trains, its optimizer, its checkpoint folder."""

    def __init__(self, model, trainable: dict[str, nn.Parameter], s: LoraSettings, out_dir: Path, fingerprint: str):
        self.model, self.trainable, self.s = model, trainable, s
        self.opt = torch.optim.AdamW(list(trainable.values()), lr=s.lr, weight_decay=0.0)
        self.ckpt_dir = out_dir.with_name(out_dir.name + ".ckpt")
        self.fingerprint = fingerprint
        self.step, self.losses = 0, []

    def check_checkpoint(self, resume: bool) -> None:
        d = self.ckpt_dir
        if d.exists() and (not d.is_dir() or any(p.name not in CKPT_FILES for p in d.iterdir())):
            raise QwcError(f"cannot use {d} for checkpoints: it holds files qwc lora did not write "
                           "(remove it or choose another output)")
        found = (d / "state.pt").is_file()
        if found and not resume:
            raise QwcError(f"{d} holds an earlier run's checkpoint: --resume continues it (or remove it)")
        if resume and not found:
            raise QwcError(f"--resume: no checkpoint in {d}")

    def resume(self) -> None:
        path = self.ckpt_dir / "state.pt"
        try:   # tensors, numbers and dicts only: nothing in it runs code
            state = torch.load(path, weights_only=True)
        except Exception as e:   # torch raises many kinds on a damaged file (pickle, zip, runtime)
            raise QwcError(f"--resume: {path} is corrupt or truncated ({str(e).splitlines()[0][:120]})") from None
        if not isinstance(state, dict) or state.get("fingerprint") != self.fingerprint:
            raise QwcError(f"{self.ckpt_dir} holds a run with other settings, model or data; remove it to start afresh")
        adapter, step, losses = state.get("adapter"), state.get("step"), state.get("losses")
        if (not isinstance(adapter, dict) or set(adapter) != set(self.trainable)
                or any(not isinstance(v, torch.Tensor) or v.shape != self.trainable[k].shape for k, v in adapter.items())
                or isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= self.s.steps
                or not isinstance(losses, list) or len(losses) != step):
            raise QwcError(f"--resume: {path} does not hold this run's adapter, step and losses (damaged?)")
        with torch.no_grad():
            for k, v in adapter.items():
                self.trainable[k].copy_(v)
        try:
            self.opt.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, TypeError) as e:
            raise QwcError(f"--resume: {path}'s optimizer state does not fit this run ({e})") from None
        self.step, self.losses = step, losses
        progress.info(f"[qwc] resuming from step {self.step} ({self.ckpt_dir})")

    def save(self) -> None:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt_dir / "state.pt.tmp"
        torch.save({"fingerprint": self.fingerprint, "step": self.step, "losses": self.losses,
                    "adapter": {k: v.detach() for k, v in self.trainable.items()},
                    "optimizer": self.opt.state_dict()}, tmp)
        os.replace(tmp, self.ckpt_dir / "state.pt")

    def forget_checkpoint(self) -> None:
        for name in CKPT_FILES:   # only what save() wrote: never a user's file
            (self.ckpt_dir / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.ckpt_dir.rmdir()

    def loop(self, tokens: np.ndarray, mask: np.ndarray) -> float:
        """Train to the last step; returns the seconds it took."""
        s, model = self.s, self.model
        model.train()
        t0, first = time.perf_counter(), self.step
        bar = progress.bar(total=s.steps, desc="lora" + (" (QA)" if s.qa else ""), unit="step")
        bar.update(self.step)
        report = max(1, min(s.save_every, s.steps // 10))
        while self.step < s.steps:
            for g in self.opt.param_groups:
                g["lr"] = s.lr * min(1.0, (self.step + 1) / max(1, s.warmup))
            x, m = _windows(tokens, mask, s, self.step)
            logits = model(input_ids=x[:, :-1]).logits
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1), reduction="none")
            loss = (nll * m.reshape(-1)).sum() / m.sum().clamp(min=1)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(self.trainable.values()), 1.0)
            self.opt.step()
            self.step += 1
            self.losses.append(float(loss.detach()))
            if not math.isfinite(self.losses[-1]):
                raise QwcError(f"loss became {self.losses[-1]} at step {self.step}; lower --lr")
            done = self.step - first
            rate = done * s.batch * s.seq_len / (time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(self.losses[-10:]):.3f}", tok_s=f"{rate:.0f}")
            if self.step % report == 0 or self.step == s.steps:
                eta = (s.steps - self.step) * (time.perf_counter() - t0) / done
                progress.info(f"[qwc] step {self.step}/{s.steps}: loss {np.mean(self.losses[-report:]):.3f}, "
                              f"{rate:.0f} tokens/s, ETA {eta / 60:.1f} min")
            if self.step % s.save_every == 0 and self.step < s.steps:
                self.save()
        bar.close()
        model.eval()
        return time.perf_counter() - t0


def _save_qalora(layers: dict[str, QALoraLinear], s: LoraSettings, source: str, folder: Path) -> None:
    from peft import LoraConfig
    from safetensors.torch import save_file

    LoraConfig(r=s.rank, lora_alpha=s.alpha, target_modules=list(s.targets), lora_dropout=0.0, bias="none",
               task_type="CAUSAL_LM", base_model_name_or_path=str(source), use_qalora=True,
               qalora_group_size=QA_GROUP).save_pretrained(str(folder))
    tensors = {}
    for path, m in layers.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = m.lora_A.detach().contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = m.lora_B.detach().contiguous()
    save_file(tensors, str(folder / PEFT_WEIGHTS), metadata={"format": "pt"})


def train(lm: LoadedModel, ckpt: Checkpoint, source: str, data_paths: list[Path], stream, s: LoraSettings,
          out_dir: Path, resume: bool = False, threads: int | None = None) -> dict:
    """Train an adapter for `lm` (whose weights are `ckpt`'s) on `stream` (models/lora_data.py's
    tokens, target mask and digest of `data_paths`) and write it to `out_dir`."""
    s.validate()
    out_dir = Path(out_dir)
    check_destination(out_dir, folder=True, foreign=foreign_files)
    tokens, mask, digest = stream
    if threads:
        torch.set_num_threads(threads)
    model = lm.model
    model.config._attn_implementation = "sdpa"   # training speed; export reads the weights, not this module
    if s.qa:
        from .lora_merge import base_fingerprint
        # before attach_qalora: a preset's checkpoint reads the model's own tensors, which it rewrites
        base_sha = base_fingerprint(ckpt, linear_shapes(lm.config))
        layers = attach_qalora(model, ckpt, s)
        trainable = {f"{p}.lora_{ab}": getattr(m, f"lora_{ab}") for p, m in layers.items() for ab in "AB"}
    else:
        model = attach_lora(model, source, s)
        trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
        base_sha = None
    run = _Run(model, trainable, s, out_dir, _fingerprint(source, digest, s))
    run.check_checkpoint(resume)
    if resume:
        run.resume()
    n_train = sum(p.numel() for p in trainable.values())
    progress.info(f"[qwc] training {'QA-LoRA' if s.qa else 'LoRA'} rank {s.rank} on {', '.join(s.targets)}: "
                  f"{n_train:,} parameters, {len(tokens):,} tokens ({int(mask.sum()):,} targets)")
    seconds = run.loop(tokens, mask)
    record = {"command": "qwc lora", "source": str(source), "data": [str(p) for p in data_paths],
              "settings": asdict(s), "losses": run.losses, "final_loss": float(np.mean(run.losses[-10:])),
              "qa_base_sha256": base_sha}
    with staging_dir(out_dir, folder=True, foreign=foreign_files) as tmp:
        stage = tmp / out_dir.name
        if s.qa:
            _save_qalora(layers, s, source, stage)
        else:
            # no embedding layers: peft would look the base up on the hub to see if the vocabulary changed
            model.save_pretrained(str(stage), save_embedding_layers=False)
        (stage / MARKER).write_text(json.dumps(record, indent=1))
        replace_dir(stage, out_dir, foreign_files)
    run.forget_checkpoint()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"steps": s.steps, "seconds": seconds, "first_loss": run.losses[0], "final_loss": record["final_loss"],
            "peak_bytes": peak}
