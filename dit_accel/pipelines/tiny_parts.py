"""What the tiny pipeline builders share: a T5-family text encoder and its word-level tokenizer, and the
save-and-describe step that returns the info dict `make-tiny-pipeline` prints (H3, a modular pipeline
saved its own way, shares only the parameter count).

Wan, SkyReels-V2 (UMT5) and CogVideoX (T5 v1.1) all condition on a T5 encoder's last hidden state; the
tiny one is the same encoder class with the sizes below (gated-GELU feed-forward, as both real encoders),
fed by `tokenizer.build_word_tokenizer` (pad 0, eos 1: T5's ids). Its `d_model` is the transformer's text
width, so each builder passes `TEXT_DIM` on to its transformer's config.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .tokenizer import build_word_tokenizer

VOCAB_SIZE = 256
TEXT_DIM = 32  # the encoder's d_model = the width of the text tokens every tiny transformer reads

# Keys that T5Config and UMT5Config share.
T5_CONFIG = dict(vocab_size=VOCAB_SIZE, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                 dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def t5_text_encoder(kind: str = "umt5", width: int = TEXT_DIM):
    """A random tiny `UMT5EncoderModel` (kind "umt5": Wan, SkyReels-V2) or `T5EncoderModel` ("t5": CogVideoX),
    in eval mode, `width` wide (its d_model: the text width the transformer reads); its weights come from torch's
    global generator (the caller seeds it)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    encoder, config = {"umt5": (UMT5EncoderModel, UMT5Config), "t5": (T5EncoderModel, T5Config)}[kind]
    return encoder(config(**{**T5_CONFIG, "d_model": width})).eval()


def real_size_transformer(transformer_class: type, config: dict[str, Any], seed: int):
    """`transformer_class` at a preset's size (`config`, a public config): built on the meta device, then random
    weights of realistic scale (`adapters.building.synthetic_weights`, as profile-block's synthetic blocks) in
    bf16 on the CPU, the class's fp32-kept modules in fp32, as a bf16 load would type them."""
    import torch

    from ..adapters.building import fp32_kept, parameters_on_meta, synthetic_weights

    with parameters_on_meta():
        model = transformer_class(**{k: v for k, v in config.items() if not k.startswith("_")})
    keep = tuple(getattr(transformer_class, "_keep_in_fp32_modules", None) or ())
    return synthetic_weights(model, torch.device("cpu"), lambda name: fp32_kept(name, torch.bfloat16, keep), seed)


def t5_tokenizer(max_text_tokens: int):
    """The word-level stand-in for the encoder's tokenizer; `max_text_tokens` is what the pipeline pads
    prompts to (its `max_sequence_length`), kept as the tokenizer's `model_max_length` as the real one does."""
    return build_word_tokenizer(VOCAB_SIZE, model_max_length=max_text_tokens)


def params_m(pipe: Any, components: tuple[str, ...]) -> dict[str, float]:
    """Millions of parameters of each named component of `pipe`."""
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters()) / 1e6 for name in components}


def save_and_describe(pipe: Any, directory: Path, defaults: dict,
                      components: tuple[str, ...] = ("transformer", "vae", "text_encoder")) -> dict:
    """`save_pretrained` a DiffusionPipeline into `directory`; returns the builders' info dict: the pipeline
    class name, the run defaults `generate` reads, and the parameters (M) of `components`."""
    pipe.save_pretrained(str(directory))
    return {"pipeline": type(pipe).__name__, "defaults": defaults, "params_m": params_m(pipe, components)}
