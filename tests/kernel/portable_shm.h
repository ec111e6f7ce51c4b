// Test-only stand-in for sgl-kernel's csrc/cpu/x86_64/shm.h: the same four functions,
// in plain C++ with fp32 accumulation, so that the kernel's shm.cpp (and the group
// set-up around it) builds and runs on any x86-64 host, AVX-512 or not.
// scripts/build_cpu_kernel.py --portable puts it in place of the AVX-512 header.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstring>

template <typename T>
inline void portable_reduce(int start, int count, char* to_buffer, char** buffers, int world_size) {
  T* out = reinterpret_cast<T*>(to_buffer);
  for (int i = start; i < start + count; i++) {
    float sum = 0.0f;
    for (int j = 0; j < world_size; j++) {
      sum += static_cast<float>(reinterpret_cast<const T*>(buffers[j])[i]);
    }
    out[i] = static_cast<T>(sum);
  }
}

inline void reduce_bf16_buffers(int start, int count, char* to_buffer, char** buffers, int world_size) {
  portable_reduce<c10::BFloat16>(start, count, to_buffer, buffers, world_size);
}

inline void reduce_fp16_buffers(int start, int count, char* to_buffer, char** buffers, int world_size) {
  portable_reduce<c10::Half>(start, count, to_buffer, buffers, world_size);
}

inline void reduce_fp32_buffers(int start, int count, char* to_buffer, char** buffers, int world_size) {
  portable_reduce<float>(start, count, to_buffer, buffers, world_size);
}

inline void parallel_memcpy(void* to, void* from, size_t n_bytes) {
  memcpy(to, from, n_bytes);
}
