// Scheduling and statistics math of the attention kernels, shared by the device code and the host
// launcher (and testable on the host): which keys a CTA visits, how a key list is split across
// CTAs, and how partial log-sum-exps merge.
#pragma once

#include <cmath>
#include <cstdint>

#include "dinfer_kernels/attention.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/simt.h"
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace attention_math {

constexpr int kTileM = 64;  // packed (query row, head) pairs per CTA: 4 warps x 16 rows
constexpr int kTileN = 64;  // keys per K/V tile
constexpr int kMaxSplits = 32;  // the combine gives each split one lane of a warp
// Enough CTAs for two resident CTAs on each of 132 SMs: the split count aims for one full wave.
constexpr int64_t kTargetCtas = 264;

DINFER_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
DINFER_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
DINFER_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Keys that exist for a sequence: [0, L) with L = clamp(seq_len, 0, S).
DINFER_HD int32_t valid_len(int32_t seq_len, int32_t cache_len) {
  return seq_len < 0 ? 0 : (seq_len > cache_len ? cache_len : seq_len);
}

// A window row is valid (attends, is written into the cache) iff its position is a real key.
DINFER_HD bool row_valid(int64_t pos, int32_t len) { return pos >= 0 && pos < len; }

// ---- the KV cache layout -----------------------------------------------------------------------------
// Where position s of sequence b is in the caches, as the index of its row in their first two
// dimensions. Contiguous caches [B, S, Hkv, D]: (b, s). Paged (vLLM style): the caches are page
// pools [num_pages, page_size, Hkv, D] shared by the sequences, and position s is row s % page_size
// of page block_table[b, s / page_size]; a page id outside [0, num_pages) makes the position absent
// (never attended, never written), so no value of the table reaches outside the pool. The one
// address translation of the host kernel, the CUDA kernels and the host test of both.
struct KvLayout {
  const int32_t* block_table;  // [B, max_pages] or null: contiguous
  int64_t max_pages;
  int64_t num_pages;
  int32_t page_size;  // >= 1 with a block table
};

struct KvSlot {
  int64_t page;  // first index of the row: the sequence (contiguous) or the page (0 when absent)
  int32_t row;  // second index: the position (contiguous) or the row in the page
  bool present;
};

// The layout of a launch (page_size fits int32: the bindings keep cache_len below 2^31).
inline KvLayout kv_layout(const AttentionParams& p) {
  KvLayout l;
  l.block_table = p.block_table;
  l.max_pages = p.max_pages;
  l.num_pages = p.num_pages;
  l.page_size = p.block_table != nullptr ? static_cast<int32_t>(p.page_size) : 1;
  return l;
}

// s in [0, max_pages * page_size) (the kernels translate window rows below their sequence's length
// and keys below it only, both < S).
DINFER_HD KvSlot kv_slot(const KvLayout& l, int64_t b, int32_t s) {
  KvSlot r;
  if (l.block_table == nullptr) {
    r.page = b;
    r.row = s;
    r.present = true;
    return r;
  }
  const uint32_t j = static_cast<uint32_t>(s) / static_cast<uint32_t>(l.page_size);
  const int32_t id = l.block_table[b * l.max_pages + j];
  r.present = id >= 0 && id < l.num_pages;
  r.page = r.present ? id : 0;
  r.row = s - static_cast<int32_t>(j) * l.page_size;
  return r;
}

// Element offset of head g of the row of `slot` in an array with leading strides st.
DINFER_HD int64_t kv_offset(const int64_t* st, const KvSlot& slot, int64_t g) {
  return slot.page * st[0] + static_cast<int64_t>(slot.row) * st[1] + g * st[2];
}

// How a CTA walks its key list. The list is a sequence of slots (an explicit kv_indices row, or
// the implicit 0, 1, ..., count-1); slot i covers key block kb = list[i], i.e. keys
// [kb * kv_block, min((kb + 1) * kv_block, L)), visited in tiles of kTileN keys. Tiles are numbered
// by an ordinal: slot * tiles_per_block + tile-in-block, so a split is a plain ordinal range.
struct KeyWalk {
  const int32_t* list;  // null: implicit list (slot i is block i)
  int32_t num_blocks;  // NKB: valid block ids are [0, NKB); others are skipped
  int32_t kv_block;  // keys per block
  int32_t tiles_per_block;  // cdiv(min(kv_block, S), kTileN), >= 1
  int32_t len;  // L
};

struct KeyTile {
  int64_t ord;  // ordinal of this tile; valid() is false when none was found
  int32_t kb;  // key block
  int32_t k0, k1;  // keys [k0, k1), 0 < k1 - k0 <= kTileN
  bool last;  // last tile of its block (the block's statistics are complete after it)
  DINFER_HD bool valid() const { return k1 > k0; }
};

// First non-empty tile with ordinal in [ord, ord_end). Skips slots with out-of-range block ids and
// blocks past L; never reads list entries at or past slot cdiv(ord_end, tiles_per_block).
DINFER_HD KeyTile find_tile(const KeyWalk& w, int64_t ord, int64_t ord_end) {
  while (ord < ord_end) {
    const int64_t slot = ord / w.tiles_per_block;
    const int64_t sub = ord - slot * w.tiles_per_block;
    const int32_t kb = w.list != nullptr ? w.list[slot] : static_cast<int32_t>(slot);
    if (kb >= 0 && kb < w.num_blocks) {
      const int64_t bs = static_cast<int64_t>(kb) * w.kv_block;
      const int64_t be = min64(bs + w.kv_block, w.len);
      const int64_t k0 = bs + sub * kTileN;
      if (k0 < be) {
        const int64_t k1 = min64(k0 + kTileN, be);
        KeyTile t;
        t.ord = ord;
        t.kb = kb;
        t.k0 = static_cast<int32_t>(k0);
        t.k1 = static_cast<int32_t>(k1);
        t.last = k1 >= be;
        return t;
      }
    }
    ord = (slot + 1) * w.tiles_per_block;  // the rest of this block is empty too
  }
  KeyTile none;
  none.ord = ord_end;
  none.kb = -1;
  none.k0 = none.k1 = 0;
  none.last = false;
  return none;
}

// Split s of ns takes units [n*s/ns, n*(s+1)/ns): contiguous, balanced, deterministic.
DINFER_HD void split_range(int64_t n, int s, int ns, int64_t* lo, int64_t* hi) {
  *lo = n * s / ns;
  *hi = n * (s + 1) / ns;
}

// Splits of a CTA's key list. With block statistics the split unit is a whole block (a block's
// mass is finished by one CTA); otherwise a tile. At most one wave of CTAs (all CTAs stream about
// the same number of keys, so a partial second wave would nearly double the time), >= 2 tiles per
// split.
inline int num_splits(int64_t units, int64_t slots, int64_t tiles_per_block, bool by_block) {
  if (units <= 0 || slots <= 0) return 1;
  int64_t ns = kTargetCtas / units;
  const int64_t splittable = by_block ? slots : slots * tiles_per_block;
  ns = min64(ns, by_block ? splittable : max64(1, splittable / 2));
  ns = min64(ns, kMaxSplits);
  return static_cast<int>(max64(ns, 1));
}

// ---- split combine ---------------------------------------------------------------------------------

// The row's log2-domain lse from its splits' partial ones (ls[s * stride], s < ns), in split order;
// -inf when no split has a key, NaN when one is NaN. The one formula of the combine and of the block statistics, so block
// masses are normalised by exactly the lse the output reports.
DINFER_HD float splits_lse2(const float* ls, int ns, int64_t stride) {
  float mx = -INFINITY;
  bool nan = false;  // fmaxf drops NaN: a split's undefined softmax must reach the row
  for (int s = 0; s < ns; ++s) {
    mx = fmaxf(mx, ls[s * stride]);
    nan |= ls[s * stride] != ls[s * stride];
  }
  if (nan) return NAN;
  if (mx == -INFINITY) return -INFINITY;
  float sum = 0.f;
  for (int s = 0; s < ns; ++s) sum += exp2f(ls[s * stride] - mx);
  return mx + log2f(sum);
}

// A split's share 2^(ls - lse2) of the row's output (0 when the row has no key).
DINFER_HD float split_share(float ls, float lse2) { return lse2 == -INFINITY ? 0.f : exp2f(ls - lse2); }

// One warp per output row, lane s holding split s's share w: columns d, d + 1 (d = 2 lane, + 64 per
// step) of the row's output, sum_s w_s * O_s in split order, with O_s at part_o + s * split_stride;
// store(d, x0, x1) writes them. D is a multiple of 64: every lane takes part in every shuffle.
template <class Store>
DINFER_HD void combine_columns(const float* part_o, int64_t split_stride, int D, int ns, float w, int lane,
                               Store store) {
  for (int d = 2 * lane; d < D; d += 64) {
    float x0 = 0.f, x1 = 0.f;
    for (int s = 0; s < ns; ++s) {
      const float ws = simt::shfl_xor(w, lane ^ s);  // lane s's weight (xor with lane^s reads lane s)
      if (ws != 0.f) {
        const float* po = part_o + s * split_stride + d;
#if defined(__CUDA_ARCH__)
        const float2 v = *reinterpret_cast<const float2*>(po);
        x0 += ws * v.x;
        x1 += ws * v.y;
#else
        x0 += ws * po[0];
        x1 += ws * po[1];
#endif
      }
    }
    store(d, x0, x1);
  }
}

}  // namespace attention_math
DINFER_ISA_END
}  // namespace dinfer_kernels
