#pragma once
// OpenBLAS, braid's CPU GEMM, loaded at its first use (dlopen) with the kernels for this CPU.
//
// OpenBLAS built for many CPUs (DYNAMIC_ARCH, as Debian's) picks its kernels when it is loaded,
// from the CPU's model number, and falls back to its oldest x86-64 kernels (Prescott, SSE3)
// for a model it does not know: Debian 12's 0.3.21 on a 5th-generation Xeon (model 207) ran
// sgemm at 32 GFLOP/s a core instead of 150. Its OPENBLAS_CORETYPE, read at that moment, names
// the kernels instead; so where it is unset braid sets it, for the load only, from the CPU's
// features: SkylakeX with AVX-512 (F, CD, BW, DQ, VL), Haswell with AVX2 and FMA. Loading it
// here rather than linking it is what lets braid choose before OpenBLAS does.
#include <cblas.h>

#include <string>

#include "braid/kernels/ops.h"

namespace braid::ops::cpu {

struct OpenBlas {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&openblas_get_parallel) get_parallel = nullptr;
  decltype(&openblas_set_num_threads) set_num_threads = nullptr;
  ops::CpuBlas info;
};

// Loads OpenBLAS once (thread-safe); a braid::Error naming the files tried when none loads.
const OpenBlas& openblas();

}  // namespace braid::ops::cpu
