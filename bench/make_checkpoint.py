"""Random-weight Qwen2.5 checkpoints of the exact published shapes, in hub layout: config.json,
generation_config.json, bf16 safetensors shards of at most --shard-gb with
model.safetensors.index.json, and a byte-level tokenizer.json. Written shard by shard, so a
7B (15 GB) is made in about one shard of memory; seeded, so every machine gets the same bytes.

    .venv/bin/python bench/make_checkpoint.py 7b -o build/ckpt/qwen2.5-7b [--shard-gb 4] [--seed 0] [--layers N]

--layers N cuts the model to its first N layers (the 7B's 4: the `qwen2.5-7b-4layers` preset's
shape, which emulation runs and bench/n2_table.py scales to 28 layers; the 14B's 16: its
largest tensors in a checkpoint this disk holds beside its float graph).

No model hub is reachable here: these stand in for the real checkpoints in the scale table
(bench/scale.py). Their text is noise; their sizes, shapes and file layout are the real ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from qwc.config import ModelConfig
from qwc.models.checkpoint import expected_tensors
from qwc.models.tokenizer import byte_level_tokenizer, special_ids

# Qwen2.5's published config.json values (hidden, intermediate, layers, heads, kv heads,
# vocab, tied embeddings); head_dim is hidden / heads = 64 (0.5B) or 128.
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "3b": (2048, 11008, 36, 16, 2, 151936, True),
    "7b": (3584, 18944, 28, 28, 4, 152064, False),
    "14b": (5120, 13824, 48, 40, 8, 152064, False),
    "32b": (5120, 27648, 64, 40, 8, 152064, False),
}


def config(size: str, layers: int | None = None) -> ModelConfig:
    h, i, n, heads, kv, vocab, tied = SHAPES[size]
    if layers is not None:
        if not 1 <= layers <= n:
            raise SystemExit(f"make_checkpoint: --layers from 1 to {n} for {size}, got {layers}")
        n = layers
    bos, eos = special_ids(byte_level_tokenizer())
    name = f"qwen2.5-{size}-random" + (f"-{layers}layers" if layers is not None else "")
    return ModelConfig(name=name, vocab_size=vocab, hidden_size=h, intermediate_size=i,
                       num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
                       head_dim=h // heads, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, tie_word_embeddings=tied, bos_token_id=bos,
                       eos_token_ids=eos)


def hub_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "max_window_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings, "use_sliding_window": False,
        "sliding_window": cfg.max_position_embeddings, "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0], "use_cache": True,
    }


def tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):      # gains near 1, as trained models have
        return (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    std = 0.02 if name.endswith("weight") else 0.05
    return (std * torch.randn(shape, generator=gen)).to(torch.bfloat16)


def write(size: str, out: Path, shard_gb: float, seed: int, layers: int | None = None) -> None:
    cfg = config(size, layers)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_tensors(cfg)
    limit = int(shard_gb * 2**30)
    shards, cur, cur_bytes = [], [], 0
    for name, shape in shapes.items():   # tensors grouped into shards in file order
        nbytes = 2 * int(torch.tensor(shape).prod())
        if cur and cur_bytes + nbytes > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {n: tensor(n, shapes[n], gen) for n in names}
        total += sum(t.numel() * 2 for t in state.values())
        save_file(state, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        del state
        print(f"  {fname}: {len(names)} tensors", file=sys.stderr)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(hub_config(cfg), indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids}, indent=1))
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    print(f"{out}: Qwen2.5-{size} shapes, {cfg.num_hidden_layers} layers, {total / 2**30:.2f} GiB bf16 in "
          f"{len(shards)} shards", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("size", choices=sorted(SHAPES))
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, help="only the first N layers (a cut of the model)")
    a = p.parse_args()
    write(a.size, a.output, a.shard_gb, a.seed, a.layers)


if __name__ == "__main__":
    main()
