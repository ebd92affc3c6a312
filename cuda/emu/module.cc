// The nanobind module jax_flash._jax_flash_emu: the CUDA kernels emulated on the host
// (emu/targets_fwd.cc, emu/targets_bwd.cc), a module of its own so that what a user installs (jax_flash._jax_flash_ext)
// holds no emulator. Built for tests and CI with JAX_FLASH_EMULATOR=ON (cuda/CMakeLists.txt).
#include <nanobind/nanobind.h>

#include "emu/module.h"
#include "emu/simt.h"

namespace nb = nanobind;

NB_MODULE(_jax_flash_emu, m) {
  m.def(
      "registrations",
      []() {
        nb::dict cpu;
        jax_flash::AddEmulatedTargets(cpu);
        nb::dict out;
        out["cpu"] = cpu;
        return out;
      },
      "FFI handler capsules by platform: {'cpu': {'jax_flash_emu_fwd': capsule, ...}}, the CUDA "
      "kernels compiled for the host against the emulation of the SIMT model and of each PTX "
      "instruction.");
  m.def(
      "count_tiles", [](bool on) { jax_flash::emu::set_tile_counting(on); }, nb::arg("on"),
      "Starts (True: from zero) or stops the debug count of the tiles the emulated kernels compute.");
  m.def(
      "tile_counts",
      []() {
        namespace emu = jax_flash::emu;
        return nb::make_tuple(emu::tile_count(0), emu::tile_count(1), emu::tile_count(2), emu::tile_count(3),
                              emu::tile_count(4), emu::tile_count(5), emu::tile_count(6));
      },
      "(forward, backward, backward dQ kernel, forward by the plain kernel, of them masked, backward by the "
      "plain kernel, of them masked): the tiles "
      "counted since count_tiles(True).");
}
