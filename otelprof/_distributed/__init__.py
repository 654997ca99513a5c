"""Distributed training support: who this process is (`ranks`, `identity`), and how long it
waits for the others (`collectives`). Contract: DEVELOPING.md, "Distributed".
"""
