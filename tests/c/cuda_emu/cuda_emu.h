// cuda_emu.h - a small CPU emulator of the CUDA execution model, for tests that
// run a .cu file's kernels on a machine without a GPU (cuda_runtime.h next to
// this file is the stand-in runtime such a .cu file compiles against).
//
// A launch runs its blocks one after another on the calling thread. The threads
// of a block are fibers, each with its own stack, run in turn on that thread. A
// thread runs until it reaches a collective (a warp shuffle or vote, a block
// barrier): it deposits its value and lets the next thread run. The last thread
// of the warp (or block) to arrive publishes every value at once, and all of
// them go on. So the lanes of a warp are in lock-step at every point where they
// can observe each other, as on a GPU, and "device memory" is host memory.
// Errors a GPU would not report cleanly (a collective that some lanes never
// reach, lanes at different collectives, partial masks) are recorded instead of
// hanging: see TakeErrors().
#ifndef PRECIS_TESTS_CUDA_EMU_CUDA_EMU_H_
#define PRECIS_TESTS_CUDA_EMU_CUDA_EMU_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace cuda_emu {

struct Dim {
  unsigned x, y, z;
};

// Runs body once for every thread of every block (inside body, ThreadIdx() etc.
// say which). Returns false, running nothing, for a configuration a GPU rejects
// (no blocks, more than 1024 threads, grid limits); the caller records that as
// the launch error.
bool RunGrid(Dim grid, Dim block, const std::function<void()>& body);

// The running thread's coordinates (only inside RunGrid's body).
Dim ThreadIdx();
Dim BlockIdx();
Dim BlockDim();
Dim GridDim();

// Warp collectives: every lane of the calling thread's warp must call the same
// one with the full mask of the warp. Returns the 32 values the lanes passed
// (index = lane; valid until the warp's next collective).
enum WarpOp { kShfl, kVote };
const uint64_t* WarpExchange(WarpOp op, unsigned mask, uint64_t value);
unsigned LaneId();

// Block barrier (__syncthreads and its _or/_and/_count forms): every thread of
// the block must call it. Returns the reduction of value over the block.
enum BlockOp { kSync, kOr, kAnd, kCount };
int BlockBarrier(BlockOp op, int value);

// The launch error (what cudaGetLastError returns: 0 = success); Take clears it.
int TakeLaunchError();
void SetLaunchError(int error);

// Execution errors found since the last call ("" if none), like the error a
// cudaDeviceSynchronize would return; clears them.
std::string TakeErrors();

// A device-to-device (or any) copy of the stand-in cudaMemcpy*: host memory
// to host memory, at once (one in-order queue). Overlapping ranges, undefined
// for cudaMemcpy, are recorded as an execution error (and copied as memmove).
void Memcpy(void* dst, const void* src, size_t bytes);

// Counts since the program started, for tests of the tests (and of host code
// that must return before it launches or copies anything).
struct Stats {
  uint64_t launches = 0;
  uint64_t blocks = 0;
  uint64_t memcpys = 0;
};
Stats GetStats();

// a * b + c, computed with the flags of the emulated code: a test checks that
// it is not contracted into an FMA (the GPU kernels never contract where the
// emulation would compare bits).
float ProbeMulAdd(float a, float b, float c);

}  // namespace cuda_emu

#endif  // PRECIS_TESTS_CUDA_EMU_CUDA_EMU_H_
