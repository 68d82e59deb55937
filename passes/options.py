"""Options shared by the passes (one object handed to every `run(model, options)`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qwc.config import ModelConfig


@dataclass
class PassOptions:
    config: ModelConfig | None = None   # rotary constants and context length come from here
    block_size: int = 32                # 32 is llama.cpp's Q4_0; 128 trades accuracy for speed
    lm_head_bits: int = 4               # 8 keeps embedding + tied lm_head at Q8_0 (llama.cpp's default)
    keep_float: list[str] = field(default_factory=list)   # fnmatch patterns of linears left in float
    bits: int = 4                       # 8: every linear Q8_0 (llama.cpp's 8-bit format) instead of Q4_0
    q8: list[str] = field(default_factory=list)   # fnmatch patterns of linears made Q8_0 at --bits 4
    # Fold each RMSNorm gain into the linears after it. Off by default: for post-training
    # quantization it spreads the gain's outliers over every Q4_0 block (a worse perplexity on
    # SmolLM2, docs/history/accuracy.md); the compiled norm applies the gain for free inside
    # the activation quantizer. A QAT checkpoint's gains are already folded (all ones).
    fold_norm_gains: bool = False
    untie_lm_head: bool = False         # with fold_norm_gains: the lm_head's own weight, so the final norm folds
    # Token ids of calibration text: activation-aware scales before quantizing (passes/awq.py);
    # None: plain Q4_0
    awq_calibration: object = None
    # The same for GPTQ (passes/gptq.py): Q4_0 codes chosen against the calibration activations
    gptq_calibration: object = None
    # The weight format: "q4_0" (every linear Q4_0, or --bits 8) or a llama.cpp K mix ("q4_k_m",
    # "q4_k_s", "q5_k_m", "q6_k": passes/kquant_mix.py, its blocks searched by qwc/kquants.py)
    format: str = "q4_0"
    # Importance matrix for the K-quant search: {module name: [K]} read from llama-imatrix's
    # file (passes/imatrix.py), or token ids of calibration text to compute it from; None: none
    importance: dict | None = None
    imatrix_calibration: object = None
    # The prefill GEMMs' int8 activations (passes/act_scale.py): "block" (Q8_0 blocks), "row"
    # (a scale and zero point a token wherever the linear can), "auto" (row where calibration
    # text says it costs little), with the token ids of that text
    act_scale: str = "block"
    act_scale_calibration: object = None
    fold_limit: int = 4096              # largest constant (elements) canonicalize folds: shape math, never weights

    def require_config(self, why: str) -> ModelConfig:
        """The model config, for passes that cannot work without it."""
        if self.config is None:
            from qwc.errors import QwcError
            raise QwcError(f"{why} needs the model config")
        return self.config

    def validate(self) -> None:
        from qwc.errors import QwcError
        if self.block_size not in (32, 128):
            raise QwcError(f"block size {self.block_size} is not supported (32 or 128)")
        if self.bits not in (4, 8):
            raise QwcError(f"bits {self.bits} is not supported (4: Q4_0, 8: Q8_0)")
        if (self.bits == 8 or self.q8) and self.block_size != 32:
            raise QwcError("Q8_0 linears (--bits 8, --q8) take blocks of 32, not --block-size "
                           f"{self.block_size}")
        if self.lm_head_bits not in (4, 8):
            raise QwcError(f"lm-head bits {self.lm_head_bits} is not supported (4 or 8)")
        self._validate_format()
        from .act_scale import MODES
        if self.act_scale not in MODES:
            raise QwcError(f"--act-scale {self.act_scale!r} is not one of {', '.join(MODES)}")
        if (self.act_scale == "auto") != (self.act_scale_calibration is not None):
            raise QwcError("--act-scale auto measures each linear on calibration text: it needs token ids "
                           "(and only it takes them)")
        if self.untie_lm_head and not self.fold_norm_gains:
            raise QwcError("--untie-lm-head only changes anything with --fold-norm-gains (it lets the final norm's gain fold)")

    def _validate_format(self) -> None:
        from qwc.errors import QwcError

        from .kquant_mix import FORMATS
        if self.format not in FORMATS:
            raise QwcError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        weighted = self.importance is not None or self.imatrix_calibration is not None
        if self.format == "q4_0":
            if weighted:
                raise QwcError("--imatrix weighs the K-quant search: it needs a K mix (--format q4_k_m, q4_k_s, "
                               "q5_k_m or q6_k)")
            return
        for bad, why in ((self.bits == 8, "--bits 8"), (self.block_size != 32, f"--block-size {self.block_size}"),
                         (bool(self.q8), "--q8")):
            if bad:
                raise QwcError(f"--format {self.format} sets every linear's format; it does not combine with {why}")
        if weighted and self.gptq_calibration is not None:
            raise QwcError("--gptq weighs its search by the calibration's own Hessian diagonal: drop --imatrix")
        if self.importance is not None and self.awq_calibration is not None:
            raise QwcError("an --imatrix file measured the model before --awq's scales; with --awq use --imatrix calib")
