"""A tiny llama-architecture GGUF the real-engine tier generates instead of downloading one.

`write_tiny_llama(path)` writes a two-layer llama with random f32 weights from a fixed seed,
a SentencePiece-style vocabulary of a few hundred tokens (llama.cpp's `"llama"` tokenizer
model: the three specials, the 256 `<0xXX>` byte-fallback tokens every byte can fall back on,
the printable ASCII characters and a few words) and a ChatML chat template, whose markers are
control tokens. About half a megabyte: llama-server loads it in well under a second on CPU.
Its output is gibberish; the protocol around it (readiness, streaming, usage, metrics) is the
real server's. Keys and tensor names are llama.cpp's (`src/models/llama.cpp`,
`llama_model_base::load_hparams`, `llama_vocab::impl::load`).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Final

import numpy as np

# gguf is the tier's own dependency (`.[real-engine]`), not the main suite's: `mypy` on a
# clean clone with only `.[test]` must pass without it.
from gguf import GGUFWriter, TokenType  # type: ignore[import-not-found, unused-ignore]

__all__ = ["CHAT_TEMPLATE", "CONTEXT_LENGTH", "vocabulary", "write_tiny_llama"]

CONTEXT_LENGTH: Final = 8192  # room for a few long generations on the server's slots
EMBEDDING: Final = 64
HEADS: Final = 4
KV_HEADS: Final = 2  # grouped-query attention, as in current llamas
FEED_FORWARD: Final = 128
LAYERS: Final = 2
RMS_EPS: Final = 1e-5

# ChatML: llama.cpp recognises it by its markers even without a Jinja engine.
CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIALS: Final = (("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL),
                    ("</s>", TokenType.CONTROL))  # fmt: skip
_MARKERS: Final = ("<|im_start|>", "<|im_end|>")
_WORDS: Final = ("the", "hello", "world", "user", "assistant", "model", "token", "engine")
_SPACE: Final = "\u2581"  # SentencePiece's word-boundary mark


def vocabulary() -> list[tuple[str, float, TokenType]]:
    """(text, score, type) for every token, in id order: `<unk>` 0, `<s>` 1, `</s>` 2 (the
    ids llama.cpp assumes for an SPM vocabulary), then bytes, characters and words. A higher
    score is merged first, so whole words win over their letters."""
    tokens: list[tuple[str, float, TokenType]] = [(t, 0.0, kind) for t, kind in _SPECIALS]
    tokens += [(f"<0x{b:02X}>", 0.0, TokenType.BYTE) for b in range(256)]
    tokens += [(m, 0.0, TokenType.CONTROL) for m in _MARKERS]
    chars = [_SPACE, *(c for c in string.printable if c.isprintable() and c != " ")]
    tokens += [(c, -1.0, TokenType.NORMAL) for c in chars]
    tokens += [(_SPACE + w, float(len(w)), TokenType.NORMAL) for w in _WORDS]
    return tokens


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write the tiny model to `path` (the same bytes for the same seed); `path`."""
    tokens = vocabulary()
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("nvpair-tiny-llama")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([text for text, _, _ in tokens])
    writer.add_token_scores([score for _, score, _ in tokens])
    writer.add_token_types([int(kind) for _, _, kind in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, shape in _tensor_shapes(len(tokens)):
        writer.add_tensor(name, _weights(rng, name, shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensor_shapes(vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor llama.cpp's llama loader asks for, with numpy shapes (ggml's reversed)."""
    head = EMBEDDING // HEADS
    shapes = [("token_embd.weight", (vocab, EMBEDDING)), ("output_norm.weight", (EMBEDDING,)),
              ("output.weight", (vocab, EMBEDDING))]  # fmt: skip
    for i in range(LAYERS):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (EMBEDDING,)),
            (f"blk.{i}.attn_q.weight", (HEADS * head, EMBEDDING)),
            (f"blk.{i}.attn_k.weight", (KV_HEADS * head, EMBEDDING)),
            (f"blk.{i}.attn_v.weight", (KV_HEADS * head, EMBEDDING)),
            (f"blk.{i}.attn_output.weight", (EMBEDDING, HEADS * head)),
            (f"blk.{i}.ffn_norm.weight", (EMBEDDING,)),
            (f"blk.{i}.ffn_gate.weight", (FEED_FORWARD, EMBEDDING)),
            (f"blk.{i}.ffn_down.weight", (EMBEDDING, FEED_FORWARD)),
            (f"blk.{i}.ffn_up.weight", (FEED_FORWARD, EMBEDDING)),
        ]
    return shapes


def _weights(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)  # RMS-norm gains: identity
    return (rng.standard_normal(shape) * 0.1).astype(np.float32)
