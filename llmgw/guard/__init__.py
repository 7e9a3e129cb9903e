"""Guardrails (``docs/guardrails.md``): policies combined along a key's
path in the tree, pattern rules run in one pass over each text (hyperscan),
their actions on prompts and answers, streams included.

Placed below llmgw.control and above llmgw.router in the layers: it imports the
settings and the error tree, never the gateway.
"""

from .apply import ContentFiltered, Redactor, Verdict, guard_chat_doc, guard_text
from .policy import Direction, Guard, Guards, policy_names

__all__ = [
    "ContentFiltered",
    "Direction",
    "Guard",
    "Guards",
    "Redactor",
    "Verdict",
    "guard_chat_doc",
    "guard_text",
    "policy_names",
]
