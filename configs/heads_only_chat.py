"""Heads for an instruct model you bring (`mtp-import`), self-distilled on its own answers to the
prompts of a JSONL file of chat records (docs/training.md#a-jsonl-corpus):

  mtp-train --config=configs/heads_only_chat.py --workdir=DIR --config.train.init_from=MODEL_DIR \
      --config.data.path=chats.jsonl

Each `{"messages": [...]}` record's conversation up to its last user message, rendered with the
model's chat template (its chat_template.jinja), prompts the trunk; the heads learn the trunk's
greedy answer. Prompts longer than distill_prompt_len keep their end. `{"text": ...}` records are
prompted with their text's windows, as text files are.
"""

from configs import heads_only


def get_config():
  c = heads_only.get_config()
  c.data.update(format="jsonl", seq_len=512)
  c.train.update(distill_prompt_len=256)
  return c
