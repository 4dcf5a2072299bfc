// Quantized mat-vec for many rows at once, each row's sums in one fixed order (compiled by
// NVRTC after common.cuh; see matvec.rs).
//
// y[r][f] = sum over k of W[f][k] * x[r][k], W in a GGUF type, x in Q8_1 blocks of 32 (the
// layout the step's kernels write). A warp computes one output feature f for a tile of up
// to TILE activation rows: lane l takes the 32-value units l, l + 32, ... of W's row, turns
// each into integers once, and adds its products with every row of the tile (dp4a), so a
// weight is read once per tile instead of once per row. A row's result is its lanes'
// partial sums, each in unit order, then a fixed butterfly over the lanes: it does not
// depend on how many rows share the tile, the launch, or the pass.

// MATVEC_TILE (TILE below) and MATVEC_WARPS (WARPS) come from the host (mod.rs's `source`),
// which sizes the grid by them.
#define TILE MATVEC_TILE
#define WARPS MATVEC_WARPS

// Four bytes at a 2-byte aligned address (Q6_K, Q5_0 and Q8_0 blocks are 2-aligned).
__device__ __forceinline__ int load_2aligned(const u8* p) {
    const u16* h = (const u16*)p;
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}

// One activation row's Q8_1 block: its scale, the sum of the values it was quantized from,
// and its 32 values as 8 ints of 4 bytes.
struct Q8Block {
    float d;
    float sum;
    int q[8];
};

__device__ __forceinline__ void load_q8(const u8* block, Q8Block& b) {
    b.d = f16_to_f32(*(const u16*)block);
    b.sum = f16_to_f32(*(const u16*)(block + 2));
    const int* q = (const int*)(block + 4);
#pragma unroll
    for (int i = 0; i < 8; ++i) b.q[i] = q[i];
}

// A weight unit: 32 values as ints of 4 signed bytes, and how each half of 16 scales.
struct Unit {
    int q[8];
    float scale[2];    // multiplies sum(q * x8) of values 0..15 and 16..31
    float offset;      // multiplies sum(x8) over all 32 (K-quant minimums)
    float sum_offset;  // multiplies the activations' own sum (Q5_0's -16, as candle's kernel)
};

__device__ __forceinline__ float dot_unit(const Unit& w, const Q8Block& x) {
    int lo = 0, hi = 0, all = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) lo = __dp4a(w.q[i], x.q[i], lo);
#pragma unroll
    for (int i = 4; i < 8; ++i) hi = __dp4a(w.q[i], x.q[i], hi);
    if (w.offset != 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; ++i) all = __dp4a(0x01010101, x.q[i], all);
    }
    return x.d * (w.scale[0] * (float)lo + w.scale[1] * (float)hi - w.offset * (float)all) -
           w.sum_offset * x.sum;
}

// Q8_0: 34 bytes: f16 d, 32 int8.
__device__ __forceinline__ void unit_q8_0(const u8* row, int u, Unit& w) {
    const u8* b = row + (u64)u * 34;
    const float d = f16_to_f32(*(const u16*)b);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = load_2aligned(b + 2 + 4 * i);
    w.scale[0] = w.scale[1] = d;
    w.offset = w.sum_offset = 0.0f;
}

// Q5_0: 22 bytes: f16 d, u32 high bits, 16 bytes of low nibbles (values j and j + 16), each
// value minus 16. The 16 comes off as candle's kernel takes it off: times the activations'
// stored sum, so that both round alike.
__device__ __forceinline__ void unit_q5_0(const u8* row, int u, Unit& w) {
    const u8* b = row + (u64)u * 22;
    const float d = f16_to_f32(*(const u16*)b);
    const u32 qh = (u32)load_2aligned(b + 2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 lo4 = (u32)load_2aligned(b + 6 + 4 * i);
        u32 low = lo4 & 0x0F0F0F0F, high = (lo4 >> 4) & 0x0F0F0F0F;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            low |= ((qh >> (4 * i + j)) & 1) << (8 * j + 4);
            high |= ((qh >> (16 + 4 * i + j)) & 1) << (8 * j + 4);
        }
        w.q[i] = (int)low;
        w.q[i + 4] = (int)high;
    }
    w.scale[0] = w.scale[1] = d;
    w.offset = 0.0f;
    w.sum_offset = 16.0f * d;
}

// Q4_K: 144 bytes a 256-value block: f16 d, f16 dmin, 12 bytes of 6-bit scales and
// minimums, 128 bytes of nibbles (sub-block 2j in the low nibbles of bytes 32j..32j+31,
// 2j + 1 in their high nibbles). Unit u is sub-block u % 8 of block u / 8.
__device__ __forceinline__ void unit_q4_k(const u8* row, int u, Unit& w) {
    const u8* b = row + (u64)(u / 8) * 144;
    const int s = u % 8;
    const float d = f16_to_f32(*(const u16*)b);
    const float dmin = f16_to_f32(*(const u16*)(b + 2));
    const u8* sc = b + 4;
    int scale, minimum;
    if (s < 4) {
        scale = sc[s] & 63;
        minimum = sc[s + 4] & 63;
    } else {
        scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
        minimum = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
    const int* qs = (const int*)(b + 16 + 32 * (s / 2));
    const int shift = (s % 2) * 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = (qs[i] >> shift) & 0x0F0F0F0F;
    w.scale[0] = w.scale[1] = d * (float)scale;
    w.offset = dmin * (float)minimum;
    w.sum_offset = 0.0f;
}

// Q6_K: 210 bytes a 256-value block: 128 bytes of low nibbles, 64 of 2-bit high parts, 16
// int8 scales (one per 16 values), f16 d. Values 128h + 32g + l (h < 2, g < 4, l < 32) take
// the low (g < 2) or high nibble of byte 64h + 32(g % 2) + l, bits 2g of high byte 32h + l,
// and scale 8h + 2g + l / 16; each minus 32.
__device__ __forceinline__ void unit_q6_k(const u8* row, int u, Unit& w) {
    const u8* b = row + (u64)(u / 8) * 210;
    const int c = u % 8, h = c / 4, g = c % 4;
    const u8* ql = b + 64 * h + 32 * (g % 2);
    const u8* qh = b + 128 + 32 * h;
    const signed char* sc = (const signed char*)(b + 192) + 8 * h + 2 * g;
    const float d = f16_to_f32(*(const u16*)(b + 208));
    const int shift = g < 2 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 low = ((u32)load_2aligned(ql + 4 * i) >> shift) & 0x0F0F0F0F;
        const u32 high = (((u32)load_2aligned(qh + 4 * i) >> (2 * g)) & 0x03030303) << 4;
        w.q[i] = (int)__vsub4(low | high, 0x20202020);
    }
    w.scale[0] = d * (float)sc[0];
    w.scale[1] = d * (float)sc[1];
    w.offset = w.sum_offset = 0.0f;
}

// The kernel for one weight type, F output features a warp. Grid (ceil(n / (WARPS * F)),
// ceil(rows / TILE)), WARPS warps a block. x: rows of x_blocks Q8_1 blocks; y: rows of n
// f32. A warp loads each activation block once for its F features, so F > 1 cuts the
// activation reads by F where many rows make them the bulk of the traffic; every (feature,
// row) sum is added in the same order whatever F, so both variants give the same bits.
#define MATVEC(NAME, UNIT, ROW_BYTES_PER_UNIT_NUM, ROW_BYTES_PER_UNIT_DEN, F)                  \
    extern "C" __global__ void NAME(const u8* weight, const u8* x, float* y, int k, int n,   \
                                    int rows, int x_blocks) {                                \
        const int lane = threadIdx.x % 32;                                                    \
        const int f0 = (blockIdx.x * WARPS + threadIdx.x / 32) * F;                           \
        const int first = blockIdx.y * TILE;                                                  \
        if (f0 >= n) return;                                                                  \
        const int tile = min(TILE, rows - first);                                             \
        const int units = k / 32;                                                             \
        const u64 row_bytes = (u64)units * ROW_BYTES_PER_UNIT_NUM / ROW_BYTES_PER_UNIT_DEN;   \
        float acc[F][TILE];                                                                   \
        _Pragma("unroll") for (int i = 0; i < F; ++i)                                         \
            _Pragma("unroll") for (int r = 0; r < TILE; ++r) acc[i][r] = 0.0f;                \
        for (int u = lane; u < units; u += 32) {                                              \
            Unit w[F];                                                                        \
            /* Past the last feature a warp repeats it and writes nothing. */                 \
            _Pragma("unroll") for (int i = 0; i < F; ++i)                                     \
                UNIT(weight + (u64)min(f0 + i, n - 1) * row_bytes, u, w[i]);                  \
            _Pragma("unroll") for (int r = 0; r < TILE; ++r) {                                \
                if (r < tile) {                                                               \
                    Q8Block xb;                                                               \
                    load_q8(x + ((u64)(first + r) * x_blocks + u) * Q8_1_BYTES, xb);          \
                    _Pragma("unroll") for (int i = 0; i < F; ++i) acc[i][r] += dot_unit(w[i], xb); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("unroll") for (int i = 0; i < F; ++i) {                                       \
            _Pragma("unroll") for (int r = 0; r < TILE; ++r) {                                \
                float s = warp_sum(acc[i][r]);                                                \
                if (lane == 0 && r < tile && f0 + i < n) y[(u64)(first + r) * n + f0 + i] = s; \
            }                                                                                 \
        }                                                                                     \
    }

// Bytes of a row per 32-value unit, as a fraction: Q8_0 34/1, Q5_0 22/1, Q4_K 144/8, Q6_K 210/8.
MATVEC(duet_matvec_q8_0, unit_q8_0, 34, 1, 1)
MATVEC(duet_matvec_q5_0, unit_q5_0, 22, 1, 1)
MATVEC(duet_matvec_q4_k, unit_q4_k, 144, 8, 1)
MATVEC(duet_matvec_q6_k, unit_q6_k, 210, 8, 1)
MATVEC(duet_matvec_q8_0_x4, unit_q8_0, 34, 1, 4)
MATVEC(duet_matvec_q5_0_x4, unit_q5_0, 22, 1, 4)
MATVEC(duet_matvec_q4_k_x4, unit_q4_k, 144, 8, 4)
MATVEC(duet_matvec_q6_k_x4, unit_q6_k, 210, 8, 4)
