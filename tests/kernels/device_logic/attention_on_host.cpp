// The attention kernels' scheduling and split combine (csrc/attention/attention.cu) executed on the
// host: the key walk of every split of one (sequence, kv head, query block) work unit, with the
// launcher's plan and the forward kernel's loop over attention_math::find_tile, the epilogue's
// per-row combine (attention_math::splits_lse2 / split_share / combine_columns) run lane by lane by the SIMT
// emulator, and the cache address translation of the paged layout (attention_math::kv_slot /
// kv_offset, which the prologue, the forward kernel's tile loads and the restore call per row).
// Built and loaded by tests/kernels/test_device_logic.py through ctypes.
#include <cmath>
#include <cstdint>

#include "dinfer_kernels/attention.h"
#include "dinfer_kernels/detail/attention_math.h"
#include "simt_host.h"

using namespace dinfer_kernels;
using namespace dinfer_kernels::attention_math;

// Tiles visited by every split, in split order: rows of (split, key block, k0, k1, last). `list` is a
// kv_indices row of max_blocks entries with count kv_num_blocks (null: no block mask); `units` is the
// launch's work-unit count, which sets the split count (written to splits_out). Returns the number of
// tiles (at most max_out are written). Mirrors make_plan and attention_fwd_kernel's walk.
extern "C" int64_t dinfer_attention_walk_on_host(const int32_t* list, int32_t kv_num_blocks,
                                                 int32_t max_blocks, int32_t seq_len, int32_t S,
                                                 int32_t kv_block, int32_t mass, int64_t units, int32_t* out,
                                                 int64_t max_out, int32_t* splits_out) {
  const bool has_list = list != nullptr;
  const int64_t walk_kv_block = has_list || mass ? kv_block : kTileN;
  const int64_t walk_nkb = attention_num_kv_blocks(S, walk_kv_block);
  const int64_t span = walk_kv_block < S ? walk_kv_block : S;
  const int64_t tiles_per_block = span > 0 ? cdiv(span, kTileN) : 1;
  const int ns = num_splits(units, has_list ? max_blocks : walk_nkb, tiles_per_block, mass != 0);
  *splits_out = ns;

  KeyWalk walk;
  walk.num_blocks = static_cast<int32_t>(walk_nkb);
  walk.kv_block = static_cast<int32_t>(walk_kv_block);
  walk.tiles_per_block = static_cast<int32_t>(tiles_per_block);
  walk.len = valid_len(seq_len, S);
  int64_t count;
  if (has_list) {
    count = kv_num_blocks < 0 ? 0 : (kv_num_blocks > max_blocks ? max_blocks : kv_num_blocks);
    walk.list = list;
  } else {
    count = cdiv(walk.len, walk_kv_block);
    walk.list = nullptr;
  }
  int64_t n = 0;
  for (int split = 0; split < ns; ++split) {
    int64_t ord0, ord1;
    if (mass) {
      split_range(count, split, ns, &ord0, &ord1);
      ord0 *= tiles_per_block;
      ord1 *= tiles_per_block;
    } else {
      split_range(count * tiles_per_block, split, ns, &ord0, &ord1);
    }
    for (KeyTile cur = find_tile(walk, ord0, ord1); cur.valid(); cur = find_tile(walk, cur.ord + 1, ord1)) {
      if (n < max_out) {
        int32_t* r = out + 5 * n;
        r[0] = split;
        r[1] = cur.kb;
        r[2] = cur.k0;
        r[3] = cur.k1;
        r[4] = cur.last ? 1 : 0;
      }
      ++n;
    }
  }
  return n;
}

// The epilogue's combine of `rows` rows, one emulated warp each: part_lse [ns, rows] (log2 domain),
// part_o [ns, rows, D]; out [rows, D] fp32 (the kernel rounds it to the dtype), lse2 [rows].
// Returns 0, or 2 if a warp deadlocked.
extern "C" int dinfer_attention_combine_on_host(const float* part_lse, const float* part_o, int32_t ns,
                                                int32_t rows, int32_t D, float* out, float* lse2) {
  for (int32_t row = 0; row < rows; ++row) {
    const bool ok = simt::host::run_cta(32, [&] {
      const int lane = simt::thread_index();
      const float lse = splits_lse2(part_lse + row, ns, rows);
      const float ls = lane < ns ? part_lse[static_cast<int64_t>(lane) * rows + row] : -INFINITY;
      combine_columns(part_o + static_cast<int64_t>(row) * D, static_cast<int64_t>(rows) * D, D, ns,
                      split_share(ls, lse), lane, [&](int d, float x0, float x1) {
                        out[static_cast<int64_t>(row) * D + d] = x0;
                        out[static_cast<int64_t>(row) * D + d + 1] = x1;
                      });
      if (lane == 0) lse2[row] = lse;
    });
    if (!ok) return 2;
  }
  return 0;
}

// The element offset of head `head` of the cache row of every position s < max_pages * page_size of
// every sequence b < B, as the kernels compute it (kv_slot, then kv_offset with the cache's leading
// strides): out[b * S + s], or -1 where the position is absent. table null: contiguous caches.
extern "C" void dinfer_attention_kv_offsets_on_host(const int32_t* table, int64_t B, int64_t max_pages,
                                                    int32_t page_size, int64_t num_pages,
                                                    const int64_t* strides, int64_t head, int64_t* out) {
  KvLayout layout;
  layout.block_table = table;
  layout.max_pages = max_pages;
  layout.num_pages = num_pages;
  layout.page_size = page_size;
  const int64_t S = max_pages * page_size;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      const KvSlot at = kv_slot(layout, b, static_cast<int32_t>(s));
      out[b * S + s] = at.present ? kv_offset(strides, at, head) : -1;
    }
  }
}
