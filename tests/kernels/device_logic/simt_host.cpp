// Fibers (ucontext) for the SIMT emulator of simt_host.h.
#include "simt_host.h"

#include <ucontext.h>

#include <cstdint>
#include <vector>

#include "dinfer_kernels/detail/simt.h"

namespace dinfer_kernels {
namespace simt {
namespace host {
namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;

enum class Wait { kRunnable, kWarpBarrier, kBlockBarrier, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Wait wait = Wait::kRunnable;
};

struct Cta {
  std::vector<Fiber> threads;
  std::vector<uint32_t> exchange;  // one word per thread: what a collective contributes
  ucontext_t scheduler;
  int current = -1;
  const std::function<void()>* body = nullptr;
};

Cta* g_cta = nullptr;

void park(Wait w) {
  Fiber& me = g_cta->threads[g_cta->current];
  me.wait = w;
  swapcontext(&me.ctx, &g_cta->scheduler);
}

void fiber_main() {
  (*g_cta->body)();
  park(Wait::kDone);  // never resumed
}

int lane() { return g_cta->current % kWarp; }
int warp_base() { return g_cta->current - lane(); }

// Every lane publishes v, then reads lane `src`'s (src < 0: its own value).
uint32_t exchange(uint32_t v, int src) {
  g_cta->exchange[g_cta->current] = v;
  sync_warp();
  const uint32_t r = src < 0 ? v : g_cta->exchange[warp_base() + src];
  sync_warp();  // nobody overwrites its word before every lane has read
  return r;
}

// Releases the barriers every live thread of their scope has reached; false if none could be.
bool release(Cta& c) {
  const int n = static_cast<int>(c.threads.size());
  bool released = false;
  bool all_block = true, any_live = false;
  for (int w = 0; w < n; w += kWarp) {
    bool all_warp = true, live = false;
    for (int l = w; l < w + kWarp; ++l) {
      const Wait s = c.threads[l].wait;
      if (s == Wait::kDone) continue;
      live = any_live = true;
      all_warp = all_warp && s == Wait::kWarpBarrier;
      all_block = all_block && s == Wait::kBlockBarrier;
    }
    if (live && all_warp) {
      for (int l = w; l < w + kWarp; ++l)
        if (c.threads[l].wait == Wait::kWarpBarrier) c.threads[l].wait = Wait::kRunnable;
      released = true;
    }
  }
  if (!released && any_live && all_block) {
    for (Fiber& f : c.threads)
      if (f.wait == Wait::kBlockBarrier) f.wait = Wait::kRunnable;
    released = true;
  }
  return released || !any_live;
}

}  // namespace

int thread_index() { return g_cta->current; }
void sync_warp() { park(Wait::kWarpBarrier); }
void sync_block() { park(Wait::kBlockBarrier); }
uint32_t shfl(uint32_t v, int src_lane) { return exchange(v, src_lane % kWarp); }
uint32_t shfl_xor(uint32_t v, int lane_mask) { return exchange(v, (lane() ^ lane_mask) % kWarp); }
uint32_t shfl_up(uint32_t v, int delta) { return exchange(v, lane() >= delta ? lane() - delta : -1); }

uint32_t match_any(uint32_t v) {
  g_cta->exchange[g_cta->current] = v;
  sync_warp();
  uint32_t mask = 0;
  for (int l = 0; l < kWarp; ++l) {
    const int t = warp_base() + l;
    if (g_cta->threads[t].wait != Wait::kDone && g_cta->exchange[t] == v) mask |= 1u << l;
  }
  sync_warp();
  return mask;
}

bool run_cta(int num_threads, const std::function<void()>& body) {
  static Cta cta;  // fiber stacks are reused from CTA to CTA
  Cta& c = cta;
  if (static_cast<int>(c.threads.size()) != num_threads) {
    c.threads = std::vector<Fiber>(static_cast<size_t>(num_threads));
    c.exchange.assign(static_cast<size_t>(num_threads), 0u);
  }
  c.body = &body;
  g_cta = &c;
  for (Fiber& f : c.threads) {
    f.stack.resize(kStackBytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    f.wait = Wait::kRunnable;
  }
  for (;;) {
    for (int i = 0; i < num_threads; ++i) {
      if (c.threads[i].wait != Wait::kRunnable) continue;
      c.current = i;
      swapcontext(&c.scheduler, &c.threads[i].ctx);
    }
    bool done = true;
    for (const Fiber& f : c.threads) done = done && f.wait == Wait::kDone;
    if (done) break;
    if (!release(c)) {
      g_cta = nullptr;
      return false;
    }
  }
  g_cta = nullptr;
  return true;
}

}  // namespace host
}  // namespace simt
}  // namespace dinfer_kernels
