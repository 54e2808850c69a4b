"""Tooling for the architecture support table (eval/arch_support.py)."""
