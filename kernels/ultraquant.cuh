// ultraquant.cuh: parameter blocks of the KV-cache kernels in ultraquant.cu.
//
// Mirrored field for field by `#[repr(C)]` structs in src/kernel_params.rs, whose layout
// tests pin every offset below. Change both or neither.
#pragma once
#include <stdint.h>

// Store: rotate K, quantize K and V, write one UltraQuant slot per (sequence, token, head).
// Sequence s = seq_base + i (i < n_seq) writes its `tokens` new tokens at positions
// lens[s], lens[s] + 1, ... (lens is read before the host updates it).
struct UqStoreParams {
    uint8_t* cache;          // offset  0: slots [batch][capacity][kv_heads][slot], 16-byte aligned
    const void* k;           // offset  8: bf16 [n_seq][tokens][kv_heads][head_dim], contiguous
    const void* v;           // offset 16: bf16, same shape as k
    const uint32_t* lens;    // offset 24: [batch] current lengths (write positions)
    float c;                 // offset 32: scale constant (0.156)
    int seq_base;            // offset 36: first sequence written
    int n_seq;               // offset 40: sequences written
    int tokens;              // offset 44: new tokens per sequence
    int kv_heads;            // offset 48
    int capacity;            // offset 52: tokens per sequence in the cache
    int head_dim;            // offset 56: must equal the kernel's D
    int _pad;                // offset 60
};                           // size 64

// Read back: out = bf16 [2][count][kv_heads][head_dim], K (dequantized, un-rotated) then
// V, for tokens start .. start + count of sequence `seq`.
struct UqReadParams {
    const uint8_t* cache;    // offset  0
    void* out;               // offset  8
    int seq;                 // offset 16
    int start;               // offset 20
    int count;               // offset 24
    int kv_heads;            // offset 28
    int capacity;            // offset 32
    int head_dim;            // offset 36: must equal the kernel's D
};                           // size 40

// Split-KV decode attention (UltraQuant or BF16 cache). Grid (splits, kv_heads *
// head_chunks, batch). With part_splits == 1 the kernel writes `out`; otherwise it writes
// partials split_base .. split_base + splits - 1 of part_splits, and then either
// cfp4_kv_combine merges them (counters == null) or the last CTA of each (sequence, head
// group) to finish, over all launches writing the partials, merges them itself (counters:
// one per grid (y, z), zero before the first launch; the last CTA resets its counter).
// Exact window (win > 0): the UltraQuant launch attends over tokens 0 .. len - win, and a
// BF16 launch over a ring of `win` rows (capacity = win) holding the last min(len, win)
// tokens unrotated; both write partials of the same merge. The ring launch may come second
// and overlap the UltraQuant one under PDL (late_wait).
struct KvAttnParams {
    const void* q;           // offset  0: bf16 [batch][q_heads][head_dim]
    const void* k;           // offset  8: UltraQuant slots, or BF16 K [batch][capacity][kv_heads][head_dim]
    const void* v;           // offset 16: BF16 V (same shape as K); null for UltraQuant
    const uint32_t* lens;    // offset 24: [batch] tokens per sequence (1 ..= capacity)
    void* out;               // offset 32: bf16 [batch][q_heads][head_dim]
    float* part_o;           // offset 40: f32 [batch][q_heads][part_splits][head_dim], unnormalized
    float* part_ml;          // offset 48: f32 [batch][q_heads][part_splits][2]: (max, sum), log2 domain
    float scale_log2;        // offset 56: log2(e) / sqrt(head_dim)
    int q_heads;             // offset 60
    int kv_heads;            // offset 64
    int group;               // offset 68: q_heads / kv_heads
    int capacity;            // offset 72
    int splits;              // offset 76: this launch's splits (grid x)
    int head_dim;            // offset 80: must equal the kernel's D
    int win;                 // offset 84: exact window (0 = none)
    uint32_t* counters;      // offset 88: [batch][gridDim.y] finished splits, or null (then
                             //   with positions: [batch] merged groups after them)
    int split_base;          // offset 96: first partial index written by this launch
    int part_splits;         // offset 100: partials per head over all launches
    int late_wait;           // offset 104: 1 = this launch reads nothing the launch before it
                             //   writes (the exact window's ring after the UltraQuant launch):
                             //   no griddep_wait at the start, one before exiting
    int q_row;               // offset 108: elements from one sequence's q to the next
    // Rope + append fused (null positions: none): q is the decode step's raw q|k|v projection,
    // bf16 [batch][q_row] with q_row = (q_heads + 2 kv_heads) * head_dim (q heads, then k
    // heads, then v heads). Each sequence's q and k heads are rotated for positions[b] as
    // rope.cu does (bit for bit) and lens holds the lengths before the new token; lens is not
    // written but by the split merge: the combine kernel, the attention's in-kernel merge, or
    // (one split) the lengths kernel advances it after every CTA has read it.
    //   BF16 cache (win 0): the rotated k and the v of its KV heads are stored at row lens[b]
    //     (when lens[b] < capacity), and the attention covers min(lens[b] + 1, capacity) tokens.
    //   The exact window's ring (BF16, win = capacity = window): stored at row lens[b] % win,
    //     the attention covers the min(lens[b] + 1, win) rows holding the last tokens.
    //   UltraQuant (win > 0 only: the new token is read from the ring): its slot at lens[b] is
    //     encoded as the store kernel does with constant store_c, and the attention covers
    //     the tokens before the window of min(lens[b] + 1, capacity).
    const uint32_t* positions;  // offset 112: [batch]
    const void* cos;         // offset 120: bf16 [max_pos][head_dim / 2]
    const void* sin;         // offset 128: bf16, same shape
    int max_pos;             // offset 136: rows of cos / sin (a position past them reads the last)
    float store_c;           // offset 140: UltraQuant scale constant of the in-kernel store
};                           // size 144

// Merge of the split partials: out[b][h][d] = sum_s w_s o_s[d] / sum_s w_s l_s,
// w_s = 2^(m_s - max_s m_s). Grid (q_heads, batch).
struct KvCombineParams {
    const float* part_o;     // offset  0
    const float* part_ml;    // offset  8
    void* out;               // offset 16
    int q_heads;             // offset 24
    int splits;              // offset 28
    int head_dim;            // offset 32
    int _pad;                // offset 36
    uint32_t* lens;          // offset 40: [batch] lengths advanced by one after the merge (the
                             //   fused rope + append's attention); null: none
};                           // size 48

// In-place update of the per-sequence lengths (a decode step allocates nothing):
// lens[seq_base + i] = (add ? lens[seq_base + i] : 0) + value, i < n_seq. One thread each.
struct KvLensParams {
    uint32_t* lens;          // offset  0: [batch]
    int seq_base;            // offset  8
    int n_seq;               // offset 12
    int value;               // offset 16
    int add;                 // offset 20
};                           // size 24

// Decode append at the device lengths: one token per sequence, BF16 K and V
// [batch][row_elems] (row_elems = kv_heads * D) written to row lens[b] % rows of
// dst [2][batch][rows][row_elems] (K half, then V half). The BF16 cache: rows = capacity;
// the UltraQuant exact window's ring: rows = window. A sequence with lens[b] >= limit is not
// written (the host checks room first; the kernel never writes out of bounds).
struct KvAppendParams {
    const void* k;           // offset  0: bf16 [batch][row_elems], 16-byte aligned
    const void* v;           // offset  8: bf16, same shape
    void* dst;               // offset 16: bf16 [2][batch][rows][row_elems], 16-byte aligned
    const uint32_t* lens;    // offset 24: [batch]
    int batch;               // offset 32
    int rows;                // offset 36
    int row_elems;           // offset 40: a multiple of 8 (16-byte chunks)
    int limit;               // offset 44
};                           // size 48
