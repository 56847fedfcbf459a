// A lane-level model of the PTX the tensor-core kernels use, written from the PTX ISA's own
// descriptions (sections "Warp-level matrix load instruction: ldmatrix", "Matrix Fragments for
// mma.m16n8k16 with floating point type", "Data Movement and Conversion Instructions: cp.async")
// and deliberately NOT from csrc/include/dinfer_kernels/detail/mma_layout.h, whose formulas it
// tests. Warp-collective instructions take the 32 lanes' operands at once.
//
// Shared memory is b16 elements tracked in 16-byte chunks. cp.async writes land only when the
// issuing thread waits for their group; the model flags
//   - a read of a chunk whose cp.async has not landed (a missing or too shallow wait),
//   - a read of a chunk that another thread's wait landed after the last barrier (a missing
//     __syncthreads between the wait and the read),
//   - a cp.async into a chunk read since the last barrier (a missing barrier before a refill),
//   - two in-flight cp.async to one chunk, an address outside the allocation or not 16-byte
//     aligned, copies in flight at exit.
// Unwritten shared memory holds a NaN pattern, so a read of it poisons the product.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

namespace ptx_emu {

enum class B16 { kBF16, kF16 };

// ---- b16 formats ---------------------------------------------------------------------------------

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float b16_to_float(uint16_t h, B16 t) {
  if (t == B16::kBF16) return bits_to_float(static_cast<uint32_t>(h) << 16);
  const int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  float v;
  if (exp == 0)
    v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31)
    v = man ? NAN : INFINITY;
  else
    v = std::ldexp(static_cast<float>(man | 1024), exp - 25);
  return sign ? -v : v;
}

// Round to nearest even for bf16. The fp16 path only has to be right for the normal numbers the
// tests use (others give a NaN); callers check the round trip (exact_b16).
inline uint16_t float_to_b16(float x, B16 t) {
  uint16_t h;
  if (t == B16::kBF16) {
    const uint32_t u = float_to_bits(x);
    h = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  } else {
    h = 0;
    if (x != 0.f) {
      int e;
      const float m = std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
      const int exp = e + 14;
      if (exp < 1 || exp > 30) return 0x7E00;  // outside the normal range
      const int man = static_cast<int>(std::nearbyint(m * 2048.f)) - 1024;
      h = static_cast<uint16_t>((exp << 10) + man);
      if (x < 0) h |= 0x8000;
    }
  }
  return h;
}

inline bool exact_b16(float x, B16 t) { return b16_to_float(float_to_b16(x, t), t) == x; }

constexpr uint16_t kPoison = 0x7FC1;  // a NaN in bf16 and in fp16

inline uint32_t pack(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
inline uint16_t lo16(uint32_t r) { return static_cast<uint16_t>(r & 0xFFFFu); }
inline uint16_t hi16(uint32_t r) { return static_cast<uint16_t>(r >> 16); }

// ---- shared memory, cp.async groups, barriers ----------------------------------------------------

struct Hazards {
  long inflight_read = 0;  // read of a chunk whose cp.async has not landed
  long unsynced_read = 0;  // read of another thread's landed chunk before a barrier
  long war = 0;  // cp.async into a chunk read since the last barrier
  long double_copy = 0;  // two in-flight cp.async to one chunk
  long bad_address = 0;  // not 16-byte aligned, or outside the shared-memory allocation
  long exit_inflight = 0;  // copies still in flight when the CTA ends
  long total() const {
    return inflight_read + unsynced_read + war + double_copy + bad_address + exit_inflight;
  }
};

// Bank-conflict accounting: a phase (one 8x8 matrix of an ldmatrix, or 8 consecutive threads'
// 16-byte cp.async writes) moves 128 bytes; it takes as many shared-memory wavefronts as the
// largest number of distinct 4-byte words that fall into one of the 32 banks.
struct Banks {
  long phases = 0, wavefronts = 0;
  void phase(const std::vector<long>& elem_offsets_of_16b_rows) {
    std::map<int, std::vector<long>> words;
    for (long e : elem_offsets_of_16b_rows)
      for (int w = 0; w < 4; ++w) {
        const long word = e / 2 + w;
        auto& v = words[static_cast<int>(word % 32)];
        bool seen = false;
        for (long x : v) seen = seen || x == word;
        if (!seen) v.push_back(word);
      }
    size_t worst = 0;
    for (auto& kv : words) worst = kv.second.size() > worst ? kv.second.size() : worst;
    ++phases;
    wavefronts += static_cast<long>(worst);
  }
};

class Cta {
 public:
  Cta(int threads, long smem_elems)
      : threads_(threads),
        smem_(smem_elems, kPoison),
        chunks_(smem_elems / 8),
        groups_(threads),
        open_(threads) {}

  // cp.async.cg.shared.global [dst], [src], 16, src_size: src_size 0 (pred false) zero-fills.
  void cp_async(int tid, long dst, const uint16_t* src, bool pred) {
    if (!chunk_ok(dst)) return;
    Chunk& c = chunks_[dst / 8];
    if (c.pending) ++hz.double_copy;
    if (c.read_epoch == epoch_) ++hz.war;
    c.pending = true;
    Copy cp{dst, {}};
    for (int i = 0; i < 8; ++i) cp.data[i] = pred ? src[i] : 0;
    open_[tid].push_back(cp);
    pending_rows_[tid].push_back(dst);
  }
  // cp.async.commit_group: the thread's uncommitted copies become its newest group.
  void commit(int tid) {
    groups_[tid].push_back(open_[tid]);
    open_[tid].clear();
  }
  // cp.async.wait_group n: every group of the thread but the newest n has landed.
  void wait_group(int tid, int n) {
    auto& g = groups_[tid];
    while (static_cast<int>(g.size()) > n) {
      for (const Copy& cp : g.front()) {
        std::memcpy(&smem_[cp.dst], cp.data, 16);
        Chunk& c = chunks_[cp.dst / 8];
        c.pending = false;
        c.landed_epoch = epoch_;
        c.landed_by = tid;
      }
      g.erase(g.begin());
    }
  }
  // st.shared of 16 bytes by thread `tid` (a conversion pass writing a tile other threads read).
  void store_row(int tid, long elem, const uint16_t* data) {
    if (!chunk_ok(elem)) return;
    Chunk& c = chunks_[elem / 8];
    if (c.pending) ++hz.double_copy;  // a store racing a copy in flight
    if (c.read_epoch == epoch_) ++hz.war;  // over data read since the last barrier
    std::memcpy(&smem_[elem], data, 16);
    c.landed_epoch = epoch_;
    c.landed_by = tid;
  }
  void barrier() { ++epoch_; }
  // End of the CTA: nothing may still be in flight.
  void finish() {
    for (int t = 0; t < threads_; ++t) {
      for (auto& g : groups_[t]) hz.exit_inflight += static_cast<long>(g.size());
      hz.exit_inflight += static_cast<long>(open_[t].size());
    }
  }
  // One 16-byte row read by lane `tid` of a warp-collective load.
  const uint16_t* read_row(int tid, long elem) {
    if (!chunk_ok(elem)) return nullptr;
    Chunk& c = chunks_[elem / 8];
    if (c.pending)
      ++hz.inflight_read;
    else if (c.landed_by >= 0 && c.landed_epoch == epoch_ && c.landed_by != tid)
      ++hz.unsynced_read;
    c.read_epoch = epoch_;
    return &smem_[elem];
  }
  // Bank accounting of the cp.async writes issued since the last call, 8 threads per phase.
  void count_copy_banks(Banks& b) {
    for (int t0 = 0; t0 < threads_; t0 += 8) {
      size_t n = 0;
      for (int t = t0; t < t0 + 8; ++t) n = pending_rows_[t].size() > n ? pending_rows_[t].size() : n;
      for (size_t i = 0; i < n; ++i) {
        std::vector<long> rows;
        for (int t = t0; t < t0 + 8; ++t)
          if (i < pending_rows_[t].size()) rows.push_back(pending_rows_[t][i]);
        b.phase(rows);
      }
    }
    pending_rows_.clear();
  }

  Hazards hz;

 private:
  struct Chunk {
    bool pending = false;
    long landed_epoch = -1, read_epoch = -1;
    int landed_by = -1;
  };
  struct Copy {
    long dst;
    uint16_t data[8];
  };
  bool chunk_ok(long elem) {
    if (elem < 0 || elem % 8 != 0 || elem / 8 >= static_cast<long>(chunks_.size())) {
      ++hz.bad_address;
      return false;
    }
    return true;
  }
  int threads_;
  long epoch_ = 0;
  std::vector<uint16_t> smem_;
  std::vector<Chunk> chunks_;
  std::vector<std::vector<std::vector<Copy>>> groups_;
  std::vector<std::vector<Copy>> open_;
  std::map<int, std::vector<long>> pending_rows_;
};

// ---- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 -------------------------------------
// For .xN, threads 8q..8q+7 (q < N) give the addresses of rows 0..7 of matrix q (16 bytes each);
// the other threads' addresses are unused. Destination register q of each thread receives from
// matrix q: without .trans, thread l gets row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 (the
// lower element in the lower half); with .trans the matrix is delivered transposed, so thread l
// gets elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
// `warp0` is the CTA thread id of lane 0 (for the hazard model); out[l][q] is lane l's register q.
inline void ldmatrix(Cta& cta, int warp0, int num, bool trans, const long (&addr)[32], uint32_t (&out)[32][4],
                     Banks* banks) {
  for (int q = 0; q < num; ++q) {
    uint16_t m[8][8];
    std::vector<long> rows;
    for (int r = 0; r < 8; ++r) {
      const uint16_t* p = cta.read_row(warp0 + 8 * q + r, addr[8 * q + r]);
      for (int c = 0; c < 8; ++c) m[r][c] = p != nullptr ? p[c] : kPoison;
      rows.push_back(addr[8 * q + r]);
    }
    if (banks != nullptr) banks->phase(rows);
    for (int l = 0; l < 32; ++l) {
      const int a = l / 4, b = 2 * (l % 4);
      out[l][q] = trans ? pack(m[b][a], m[b + 1][a]) : pack(m[a][b], m[a][b + 1]);
    }
  }
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 -------------------------------
// The ISA's fragment tables, per thread (groupID = lane >> 2, threadID_in_group = lane % 4), for
// element i of the fragment (register i / 2, half i % 2, element 2j in the lower half):
//   A (16 x 16), a0..a7:  row = groupID for i in {0, 1, 4, 5}, else groupID + 8;
//                         col = 2 threadID_in_group + (i & 1), plus 8 for i >= 4.
//   B (16 x 8),  b0..b3:  row = 2 threadID_in_group + (i & 1), plus 8 for i >= 2; col = groupID.
//   C, D (16 x 8 fp32), c0..c3: row = groupID for i < 2, else groupID + 8;
//                         col = 2 threadID_in_group + (i & 1).
inline int a_elem_row(int lane, int i) {
  return (lane >> 2) + ((i == 0 || i == 1 || i == 4 || i == 5) ? 0 : 8);
}
inline int a_elem_col(int lane, int i) { return 2 * (lane % 4) + (i & 1) + (i >= 4 ? 8 : 0); }
inline int b_elem_row(int lane, int i) { return 2 * (lane % 4) + (i & 1) + (i >= 2 ? 8 : 0); }
inline int b_elem_col(int lane, int /*i*/) { return lane >> 2; }
inline int c_elem_row(int lane, int i) { return (lane >> 2) + (i < 2 ? 0 : 8); }
inline int c_elem_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }

// d[l] = A * B + d[l] for the warp. The products and sums of the tests' inputs are exact in fp32,
// so the order of accumulation (which the ISA leaves open) does not matter; sums are taken in
// double and rounded once.
inline void mma_m16n8k16(B16 t, float (&d)[32][4], const uint32_t (&a)[32][4], const uint32_t (&b)[32][2]) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 8; ++i) {
      const uint32_t r = a[l][i / 2];
      A[a_elem_row(l, i)][a_elem_col(l, i)] = b16_to_float(i % 2 ? hi16(r) : lo16(r), t);
    }
    for (int i = 0; i < 4; ++i) {
      const uint32_t r = b[l][i / 2];
      B[b_elem_row(l, i)][b_elem_col(l, i)] = b16_to_float(i % 2 ? hi16(r) : lo16(r), t);
    }
    for (int i = 0; i < 4; ++i) C[c_elem_row(l, i)][c_elem_col(l, i)] = d[l][i];
  }
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i) {
      const int r = c_elem_row(l, i), c = c_elem_col(l, i);
      double s = C[r][c];
      for (int k = 0; k < 16; ++k) s += static_cast<double>(A[r][k]) * B[k][c];
      d[l][i] = static_cast<float>(s);
    }
}

}  // namespace ptx_emu
