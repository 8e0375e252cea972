"""Structured output: grammars (JSON schema, regex, choice, EBNF/Lark, structural tags) compiled with
xgrammar and enforced by masking logits, so a constrained output is valid by construction."""

from kvyard.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
