"""Tokens to text and back: the chat template, detokenizing, stop strings, markup (thinking, tool calls), grammars."""
