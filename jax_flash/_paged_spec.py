"""The static description of a paged_attention call, and the attention call a compiled
paged target sees.

Below both `inference/paged.py` (which builds a PagedSpec from a call's arguments) and the
implementations that serve paged attention (their `paged_forward`, reached through the
registry): neither imports the other.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_flash._spec import AttentionSpec, MaskInputs


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    """Static description of one paged_attention call."""

    attention: AttentionSpec  # B, T, S = max_pages·page_size (the table's capacity), masks
    num_pages: int
    page_size: int
    max_pages: int
    splits: int  # split-KV chunks of the page table (1: none)

    @property
    def capacity(self) -> int:
        return self.max_pages * self.page_size


def target_masks(pspec: PagedSpec, q, table, lengths, sinks=None) -> tuple[AttentionSpec, MaskInputs]:
    """The (spec, masks) under which a compiled paged target (`jax_flash_paged_fwd`: cuda,
    cpu) sees the gathered cache of capacity S = max_pages·page_size: lengths clipped to
    [0, S], queries at L - T, and the keys of an out-of-range page id masked by kv segment
    ids (1 on such a page, 0 elsewhere and for the queries; the kernels read page 0 there)."""
    b, t = q.shape[:2]
    bad_page = (table < 0) | (table >= pspec.num_pages)  # [B, max_pages]
    masks = MaskInputs(
        kv_lengths=jnp.clip(lengths, 0, pspec.capacity),
        q_offset=jnp.maximum(lengths, 0) - t,
        q_segment_ids=jnp.zeros((b, t), jnp.int32),
        kv_segment_ids=jnp.repeat(bad_page.astype(jnp.int32), pspec.page_size, axis=1),
        sinks=sinks,
    )
    spec = dataclasses.replace(
        pspec.attention, has_segment_ids=True, has_kv_lengths=True, has_q_offset=True, has_sinks=sinks is not None
    )
    return spec, masks
