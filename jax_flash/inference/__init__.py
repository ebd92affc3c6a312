"""Inference: split-KV decoding (`split_kv`) and the paged KV cache (`paged`)."""
