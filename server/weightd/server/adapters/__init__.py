"""LoRA adapters: PEFT config parsing, verification against the base, per-rank slicing.

The pure parts (``config``, ``verify``, ``plan``) take bytes and descriptions and do no
I/O; ``load`` is the one module that reads an adapter directory.
"""
