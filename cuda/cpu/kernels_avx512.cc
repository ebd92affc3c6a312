// The algorithm for AVX-512 (16 floats per vector, 32 registers), chosen at run time.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
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
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#endif
#define JAX_FLASH_CPU_ISA avx512
#define JAX_FLASH_CPU_ISA_NAME "avx512"
#define JAX_FLASH_CPU_VECTOR_WIDTH 16
#include "cpu/kernels_isa.inc"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
