// The algorithm for the baseline ISA of the build (SSE2 on x86-64, NEON on arm64):
// the fallback that runs everywhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"

#define JAX_FLASH_CPU_ISA generic
#define JAX_FLASH_CPU_ISA_NAME "generic"
#define JAX_FLASH_CPU_VECTOR_WIDTH 4
#include "cpu/kernels_isa.inc"
