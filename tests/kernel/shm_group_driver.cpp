// Test-only: the kernel's group set-up (shm_group.cpp, taken from the patch) behind a C ABI
// for ctypes, with a plain sum over the group's workspaces standing in for the collectives.
// It needs no torch and no AVX-512: tests/test_shm_group_portable.py builds it with g++.
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shm_group.h"

namespace {

constexpr uint64_t READY = 0x7964616572;  // what init_workspace writes

struct slot {
  uint64_t ready;
  std::atomic<uint64_t> sequence;
  double values[2];  // by the parity of the sequence: a peer is at most one sum ahead
};

std::vector<void*> workspaces;
int world_rank = -1;
uint64_t sequence = 0;
std::string error;

void init_workspace(void* workspace) {
  auto* own = static_cast<slot*>(workspace);
  own->ready = READY;
  own->sequence.store(0);
}

slot* of(int rank) {
  return static_cast<slot*>(workspaces[rank]);
}

}  // namespace

extern "C" const char* driver_join(
    int64_t size, int64_t rank, const char* shm_namespace, const char* group, double timeout, uint64_t bytes) {
  try {
    workspaces = shm_group_join(size, rank, shm_namespace, group, timeout, bytes, init_workspace);
    world_rank = static_cast<int>(rank);
    return nullptr;
  } catch (const std::exception& exc) {
    error = exc.what();
    return error.c_str();
  }
}

// The sum of `value` over the group; -1 if a peer's workspace was not set up before its
// owner arrived.
extern "C" double driver_allreduce(double value) {
  sequence++;
  of(world_rank)->values[sequence % 2] = value;
  of(world_rank)->sequence.store(sequence, std::memory_order_release);
  double sum = 0;
  for (size_t r = 0; r < workspaces.size(); r++) {
    if (of(r)->ready != READY) return -1;
    while (of(r)->sequence.load(std::memory_order_acquire) < sequence) {
    }
    sum += of(r)->values[sequence % 2];
  }
  return sum;
}
