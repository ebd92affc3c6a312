// Under emulation every kernel argument passes through kernels::EmuArgument on its way into the
// launch (kernels/platform.h, found by argument-dependent lookup). For AttentionParams it tags
// the pointers to the buffers the kernels access only through the PTX wrappers (emu::tag_global),
// so that a plain C++ load or store through one of them in a kernel, e.g. `row[col] += x`
// instead of red.global.add, is the launch's error rather than an unseen access. The lengths,
// query offsets, segment ids (kernels/mask.h) and sinks (kernels/params.h) are read directly
// and stay untagged.
#pragma once

#include "emu/simt.h"
#include "kernels/params.h"

namespace jax_flash {
namespace kernels {

inline AttentionParams EmuArgument(AttentionParams p) {
  p.q = emu::tag_global(p.q);
  p.k = emu::tag_global(p.k);
  p.v = emu::tag_global(p.v);
  p.out = emu::tag_global(p.out);
  p.lse = emu::tag_global(p.lse);
  p.partial_out = emu::tag_global(p.partial_out);
  p.partial_lse = emu::tag_global(p.partial_lse);
  p.dout = emu::tag_global(p.dout);
  p.lse_in = emu::tag_global(p.lse_in);
  p.dlse = emu::tag_global(p.dlse);
  p.dq = emu::tag_global(p.dq);
  p.dk = emu::tag_global(p.dk);
  p.dv = emu::tag_global(p.dv);
  p.dq_accum = emu::tag_global(p.dq_accum);
  p.delta = emu::tag_global(p.delta);
  p.dk_accum = emu::tag_global(p.dk_accum);
  p.dv_accum = emu::tag_global(p.dv_accum);
  p.bias.data = emu::tag_global(p.bias.data);
  p.mask.data = emu::tag_global(p.mask.data);
  p.blocks.states = emu::tag_global(p.blocks.states);
  p.blocks.slots = emu::tag_global(p.blocks.slots);
  p.blocks.bits = emu::tag_global(p.blocks.bits);
  p.dbias.data = emu::tag_global(p.dbias.data);
  p.dbias_out = emu::tag_global(p.dbias_out);
  return p;
}

}  // namespace kernels
}  // namespace jax_flash
