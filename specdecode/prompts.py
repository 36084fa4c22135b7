"""Old name of `specdecode.chat` (prompt files, chat templates, per-prompt seeds).

Kept only while `specdecode/training/regen.py` imports it; new code imports `specdecode.chat`.
"""

from specdecode.chat import PromptItem, derive_seed, encode_prompt, parse_item, read_prompts_jsonl

__all__ = ["PromptItem", "derive_seed", "encode_prompt", "parse_item", "read_prompts_jsonl"]
