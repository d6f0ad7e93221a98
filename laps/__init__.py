"""laps: a length-aware LLM gateway in front of SGLang engines.

Shared pieces live here (command line, configuration, tokenizer); the
gateway, engines, policies and load generator are sibling packages.
"""

__version__ = "0.1.0"
