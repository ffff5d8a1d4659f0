"""MLA attention math (absorbed form), per-step metadata, and the four layout executors."""
