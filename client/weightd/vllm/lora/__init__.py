"""LoRA adapters served by weightd to vLLM: the resolver a request's adapter name reaches,
the HTTP middleware in front of it, and the hub that fetches, verifies and stages each
adapter version (configured by ``WEIGHTD_LORA``).
"""
