// cuda_emu.cc - the emulator of cuda_emu.h: CUDA threads as fibers on the
// launching host thread, a round-robin scheduler per block, warp and block
// collectives.
//
// Scheduling: round robin over the threads of the block; a thread runs until
// it finishes or waits at a collective, then switches straight to the next
// runnable thread after it (one switch per hand-over, no trip through the
// scheduler). A waiting thread is skipped until the generation counter of its
// warp (or block) moves, which the last thread to arrive does after publishing
// the results. When no live thread can run, control goes back to the
// scheduler: either every thread is done, or the kernel would hang on a GPU,
// which is recorded as an execution error, and the block is abandoned.
#include "cuda_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#else
#define CUDA_EMU_ASAN 0
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cuda_emu {
namespace {

constexpr unsigned kMaxThreads = 1024;
// Generous: sanitizer builds have large frames, and unused pages cost nothing.
constexpr size_t kStackBytes = size_t(256) << 10;

// ---- context switching ----------------------------------------------------------

#if defined(__x86_64__)
// A suspended context is its stack pointer, with the callee-saved registers of
// the System V ABI pushed on its stack. A hand-written switch: swapcontext
// makes a system call (signal mask) per switch, ~30x slower, and ASan's
// swapcontext interceptor clears the whole target stack's shadow each time.
// (MXCSR and the x87 control word are callee-saved too, but nothing here
// changes them, so every context has the same.)
extern "C" void cuda_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl cuda_emu_switch
  .hidden cuda_emu_switch
  .type cuda_emu_switch, @function
cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch, .-cuda_emu_switch
)");

struct Context {
  void* sp = nullptr;
};

void Switch(Context* from, Context* to) { cuda_emu_switch(&from->sp, to->sp); }

// A fresh context that starts in entry (which must never return) on the stack
// [lo, lo + size): the frame cuda_emu_switch pops, as if entry had been called.
void MakeContext(Context* c, char* lo, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                          // entry's return address (never used)
  *--sp = reinterpret_cast<void*>(entry);   // popped by ret: entry sees rsp % 16 == 8
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12-r15
  c->sp = sp;
}
#else
// Other architectures: the portable, slower ucontext.
struct Context {
  ucontext_t uc;
};

void Switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }

void MakeContext(Context* c, char* lo, size_t size, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = lo;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, entry, 0);
}
#endif

// ---- state ------------------------------------------------------------------------

struct Thread {
  Context ctx;
  char* stack = nullptr;  // lowest usable byte; a guard page lies below
  Dim idx{0, 0, 0};
  unsigned linear = 0;
  bool done = false;
  const uint64_t* wait_gen = nullptr;  // waiting until *wait_gen != wait_value
  uint64_t wait_value = 0;
  const char* wait_what = "";
  void* asan_fake_stack = nullptr;
};

struct Warp {
  unsigned size = 0;     // lanes (32 but in a partial last warp)
  unsigned arrived = 0;  // lanes at the current collective
  uint64_t gen = 0;      // collectives completed
  uint64_t value[32] = {};
  uint64_t result[32] = {};  // the values of the last completed collective
  int op[32] = {};
  unsigned mask[32] = {};
};

struct Barrier {
  unsigned arrived = 0;
  uint64_t gen = 0;
  int op = 0;
  int count = 0;  // arrivals with a nonzero value
  int result = 0;
};

struct Runner {
  Context sched;
  std::vector<Thread> threads = std::vector<Thread>(kMaxThreads);
  Warp warps[kMaxThreads / 32];
  Barrier barrier;
  unsigned nthreads = 0;
  Dim grid{0, 0, 0}, block{0, 0, 0}, block_idx{0, 0, 0};
  const std::function<void()>* body = nullptr;
  Thread* cur = nullptr;
  bool from_sched = false;    // the last switch into a thread came from the scheduler
  bool stacks_dirty = false;  // a block was abandoned: its frames are still poisoned
  // ASan's view of the scheduler's (the host thread's) stack.
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake_stack = nullptr;
  // Errors and counts, per host thread like CUDA's last error.
  int launch_error = 0;
  std::vector<std::string> errors;
  Stats stats;

  ~Runner() {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (Thread& t : threads) {
      if (t.stack != nullptr) munmap(t.stack - page, kStackBytes + page);
    }
  }
};

thread_local std::unique_ptr<Runner> t_runner;  // owns it (frees it at thread exit)
// The same, as a plain pointer: reading a thread_local without a constructor
// or destructor needs no TLS wrapper call, and this is read several times per
// emulated thread (every threadIdx & co.).
thread_local Runner* t_runner_ptr = nullptr;

__attribute__((noinline)) Runner& NewRunner() {
  t_runner.reset(new Runner());
  t_runner_ptr = t_runner.get();
  return *t_runner_ptr;
}

inline Runner& GetRunner() {
  Runner* r = t_runner_ptr;
  return __builtin_expect(r != nullptr, 1) ? *r : NewRunner();
}

void Fail(Runner& r, const std::string& msg) {
  if (r.errors.size() < 20) r.errors.push_back(msg);
}

std::string Where(const Runner& r) {
  char buf[96];
  snprintf(buf, sizeof buf, "block (%u,%u,%u) thread %u", r.block_idx.x, r.block_idx.y,
           r.block_idx.z, r.cur != nullptr ? r.cur->linear : 0u);
  return buf;
}

// Collectives are device code: outside a kernel they are a bug of the caller.
Runner& InKernel(const char* what) {
  Runner& r = GetRunner();
  if (r.cur == nullptr) {
    fprintf(stderr, "cuda_emu: %s called outside a kernel\n", what);
    abort();
  }
  return r;
}

char* AllocStack() {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    perror("cuda_emu: mmap of a fiber stack");
    abort();
  }
  mprotect(p, page, PROT_NONE);  // overflow faults instead of corrupting a neighbour
  return static_cast<char*>(p) + page;
}

// ---- switching, with ASan told which stack is live -------------------------------

bool Runnable(const Thread& t) {
  return !t.done && (t.wait_gen == nullptr || *t.wait_gen != t.wait_value);
}

// The first runnable thread after thread `from`, round robin; null if none.
Thread* NextRunnable(Runner& r, unsigned from) {
  const unsigned n = r.nthreads;
  unsigned i = from;
  for (unsigned k = 0; k < n; ++k) {
    if (++i == n) i = 0;
    if (Runnable(r.threads[i])) return &r.threads[i];
  }
  return nullptr;
}

// From the scheduler into thread t; returns when no thread can run.
void Resume(Runner& r, Thread& t) {
  r.cur = &t;
  r.from_sched = true;
  t.wait_gen = nullptr;
#if CUDA_EMU_ASAN
  __sanitizer_start_switch_fiber(&r.sched_fake_stack, t.stack, kStackBytes);
#endif
  Switch(&r.sched, &t.ctx);
#if CUDA_EMU_ASAN
  __sanitizer_finish_switch_fiber(r.sched_fake_stack, nullptr, nullptr);
#endif
  r.cur = nullptr;
}

// On a thread that was just switched into: ASan learns the scheduler's stack
// from the first switch that comes from it.
void SwitchedIn(Runner& r, void* fake_stack) {
#if CUDA_EMU_ASAN
  if (r.from_sched) {
    __sanitizer_finish_switch_fiber(fake_stack, &r.sched_stack_bottom, &r.sched_stack_size);
  } else {
    __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
  }
#else
  (void)r, (void)fake_stack;
#endif
}

// The running thread finished or waits: switch to the next runnable thread,
// or to the scheduler if there is none. Returns when the thread is resumed.
void Yield(Runner& r, bool finished) {
  Thread* t = r.cur;
  Thread* next = NextRunnable(r, t->linear);
  if (next == t) {  // (cannot happen: a thread that yields has nothing new to wait for)
    t->wait_gen = nullptr;
    return;
  }
#if CUDA_EMU_ASAN
  // A finished fiber's stack is dead: no fake stack to keep.
  void** const fake_stack_save = finished ? nullptr : &t->asan_fake_stack;
#else
  (void)finished;
#endif
  if (next == nullptr) {
#if CUDA_EMU_ASAN
    __sanitizer_start_switch_fiber(fake_stack_save, r.sched_stack_bottom, r.sched_stack_size);
#endif
    Switch(&t->ctx, &r.sched);
  } else {
    next->wait_gen = nullptr;
    r.cur = next;
    r.from_sched = false;
#if CUDA_EMU_ASAN
    __sanitizer_start_switch_fiber(fake_stack_save, next->stack, kStackBytes);
#endif
    Switch(&t->ctx, &next->ctx);
  }
  SwitchedIn(r, t->asan_fake_stack);  // r.cur is t again
}

[[noreturn]] void FiberMain() {
  Runner& r = GetRunner();
  SwitchedIn(r, nullptr);
  (*r.body)();
  r.cur->done = true;
  Yield(r, true);
  abort();  // a finished thread is never resumed
}

// Suspends the running thread until *gen != value.
void WaitFor(Runner& r, const uint64_t* gen, uint64_t value, const char* what) {
  Thread* t = r.cur;
  t->wait_gen = gen;
  t->wait_value = value;
  t->wait_what = what;
  Yield(r, false);
}

void ReportDeadlock(Runner& r) {
  unsigned waiting = 0, first = 0;
  for (unsigned i = r.nthreads; i-- > 0;) {
    if (!r.threads[i].done) ++waiting, first = i;
  }
  const Thread& t = r.threads[first];
  const Warp& w = r.warps[first / 32];
  unsigned exited = 0;
  for (unsigned i = first / 32 * 32; i < first / 32 * 32 + w.size; ++i) exited += r.threads[i].done;
  char buf[320];
  snprintf(buf, sizeof buf,
           "block (%u,%u,%u): the kernel would hang: %u threads wait forever, first thread "
           "%u at %s (its warp: %u of %u lanes there, %u exited; block barrier: %u of %u "
           "threads there)",
           r.block_idx.x, r.block_idx.y, r.block_idx.z, waiting, first, t.wait_what, w.arrived,
           w.size, exited, r.barrier.arrived, r.nthreads);
  Fail(r, buf);
}

void RunBlock(Runner& r) {
  const unsigned n = r.nthreads;
#if CUDA_EMU_ASAN
  // An abandoned block's threads (every one of them, not only this block's: a larger
  // block later runs on the rest) still hold the poisoned frames they waited in.
  for (unsigned i = 0; r.stacks_dirty && i < kMaxThreads; ++i) {
    if (r.threads[i].stack != nullptr) ASAN_UNPOISON_MEMORY_REGION(r.threads[i].stack, kStackBytes);
  }
#endif
  for (unsigned i = 0; i < n; ++i) {
    Thread& t = r.threads[i];
    if (t.stack == nullptr) t.stack = AllocStack();
    t.linear = i;
    t.idx = Dim{i % r.block.x, (i / r.block.x) % r.block.y, i / (r.block.x * r.block.y)};
    t.done = false;
    t.wait_gen = nullptr;
    t.asan_fake_stack = nullptr;
    MakeContext(&t.ctx, t.stack, kStackBytes, FiberMain);
  }
  r.stacks_dirty = false;
  for (unsigned w = 0; w * 32 < n; ++w) {
    r.warps[w].size = n - w * 32 < 32 ? n - w * 32 : 32;
    r.warps[w].arrived = 0;
  }
  r.barrier.arrived = 0;
  r.barrier.count = 0;

  // The threads hand over among themselves; back here, none can run.
  Resume(r, r.threads[0]);
  for (unsigned i = 0; i < n; ++i) {
    if (!r.threads[i].done) {
      ReportDeadlock(r);
      r.stacks_dirty = true;
      return;
    }
  }
}

}  // namespace

// ---- API --------------------------------------------------------------------------

bool RunGrid(Dim grid, Dim block, const std::function<void()>& body) {
  Runner& r = GetRunner();
  const uint64_t threads = (uint64_t)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7FFFFFFFu || grid.y > 65535u ||
      grid.z > 65535u || threads == 0 || threads > kMaxThreads || block.z > 64u) {
    return false;
  }
  if (r.body != nullptr) {
    Fail(r, "a kernel launched a kernel (dynamic parallelism is not emulated)");
    return false;
  }
  ++r.stats.launches;
  r.grid = grid;
  r.block = block;
  r.nthreads = (unsigned)threads;
  r.body = &body;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        r.block_idx = Dim{x, y, z};
        ++r.stats.blocks;
        RunBlock(r);
      }
    }
  }
  r.body = nullptr;
  return true;
}

Dim ThreadIdx() { return InKernel("threadIdx").cur->idx; }
Dim BlockIdx() { return InKernel("blockIdx").block_idx; }
Dim BlockDim() { return InKernel("blockDim").block; }
Dim GridDim() { return InKernel("gridDim").grid; }
unsigned LaneId() { return InKernel("a lane id").cur->linear % 32; }

const uint64_t* WarpExchange(WarpOp op, unsigned mask, uint64_t value) {
  Runner& r = InKernel("a warp collective");
  Thread& t = *r.cur;
  Warp& w = r.warps[t.linear / 32];
  const unsigned lane = t.linear % 32;
  const unsigned full = w.size == 32 ? 0xFFFFFFFFu : (1u << w.size) - 1u;
  if (mask != full) {
    Fail(r, Where(r) + ": a warp collective with a partial mask (not emulated)");
  }
  w.value[lane] = value;
  w.op[lane] = (int)op;
  w.mask[lane] = mask;
  const uint64_t gen = w.gen;
  if (++w.arrived == w.size) {
    // Every lane is here: check they agree on what this is, publish.
    for (unsigned l = 1; l < w.size; ++l) {
      if (w.op[l] != w.op[0] || w.mask[l] != w.mask[0]) {
        Fail(r, Where(r) + ": the lanes of a warp met at different collectives");
        break;
      }
    }
    for (unsigned l = 0; l < 32; ++l) w.result[l] = l < w.size ? w.value[l] : 0;
    w.arrived = 0;
    ++w.gen;
  } else {
    WaitFor(r, &w.gen, gen, "a warp collective");
  }
  return w.result;
}

int BlockBarrier(BlockOp op, int value) {
  Runner& r = InKernel("a block barrier");
  Barrier& b = r.barrier;
  if (b.arrived == 0) {
    b.op = (int)op;
  } else if (b.op != (int)op) {
    Fail(r, Where(r) + ": the threads of a block met at different barriers");
  }
  b.count += value != 0 ? 1 : 0;
  const uint64_t gen = b.gen;
  if (++b.arrived == r.nthreads) {
    switch (op) {
      case kSync: b.result = 0; break;
      case kOr: b.result = b.count > 0; break;
      case kAnd: b.result = b.count == (int)r.nthreads; break;
      case kCount: b.result = b.count; break;
    }
    b.arrived = 0;
    b.count = 0;
    ++b.gen;
  } else {
    WaitFor(r, &b.gen, gen, "a block barrier");
  }
  return b.result;
}

int TakeLaunchError() {
  Runner& r = GetRunner();
  const int e = r.launch_error;
  r.launch_error = 0;
  return e;
}

void SetLaunchError(int error) {
  Runner& r = GetRunner();
  if (r.launch_error == 0) r.launch_error = error;
}

std::string TakeErrors() {
  Runner& r = GetRunner();
  std::string out;
  for (const std::string& e : r.errors) out += e + "\n";
  r.errors.clear();
  return out;
}

void Memcpy(void* dst, const void* src, size_t bytes) {
  Runner& r = GetRunner();
  ++r.stats.memcpys;
  if (bytes == 0) return;
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) {
    Fail(r, "cudaMemcpy*: the source and destination ranges overlap (undefined)");
    memmove(dst, src, bytes);
    return;
  }
  memcpy(dst, src, bytes);
}

Stats GetStats() { return GetRunner().stats; }

float ProbeMulAdd(float a, float b, float c) { return a * b + c; }

}  // namespace cuda_emu
