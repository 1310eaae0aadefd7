// What meshserve's AMX kernels share (cpu_amx_linear.cpp, cpu_amx_attention.cpp): the tile
// configuration's layout, Linux's permission to use the tile state, and its release.
//
// Linux hands AMX's state to a process only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM),
// done here once. The functions that use AMX are compiled for it by attribute: the rest of
// the avx512 build stays runnable on AVX-512 CPUs without AMX, and meshserve calls the AMX
// ops only where the CPU has AMX (layers/matmul_plan.py, layers/kernels/cpu_attention.py).

#pragma once

#if defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define MESHSERVE_AMX 1

namespace meshserve_cpu {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}

// Loads `cfg` into the tile registers' configuration.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& cfg) {
  // NOTE: ldtilecfg reads the struct from memory; without the barrier GCC drops the stores
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Hands the tiles back when a thread is done (the next user, oneDNN's kernels included,
// configures its own).
__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

}  // namespace meshserve_cpu
#endif
