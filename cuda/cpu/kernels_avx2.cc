// The algorithm for AVX2 + FMA (8 floats per vector), chosen at run time.
#if defined(__x86_64__) || defined(_M_X64)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// Shared (baseline-ISA) headers come before the target pragma; see vec.h.
#include "cpu/convert.h"
#include "cpu/kernel_table.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define JAX_FLASH_CPU_ISA avx2
#define JAX_FLASH_CPU_ISA_NAME "avx2"
#define JAX_FLASH_CPU_VECTOR_WIDTH 8
#include "cpu/kernels_isa.inc"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
