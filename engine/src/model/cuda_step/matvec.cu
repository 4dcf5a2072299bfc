// Quantized mat-vec for many rows at once, each row's sums in one fixed order (compiled by
// NVRTC after common.cuh; see matvec.rs).
//
// y[r][f] = sum over k of W[f][k] * x[r][k], W in a GGUF type, x in Q8_1 blocks of 32 (the
// layout the step's kernels write). Two designs:
// - warp per feature (`matvec_tiled`): a warp computes one output feature f (or four) for a
//   tile of up to TILE activation rows: lane l takes the 32-value units l, l + 32, ... of W's
//   row, turns each into integers once, and adds its products with every row of the tile
//   (dp4a), so a weight is read once per tile instead of once per row. A row's result is its
//   lanes' partial sums, each in unit order, then a fixed butterfly over the lanes.
// - tensor cores (`matvec_mma`, sm_80 and later): int8 MMAs of 16 features by 8 rows, one
//   unit at a time, scaled per cell in unit order (see the kernel); for a few rows its sums
//   without tensor cores (`matvec_few`), bit for bit.
// Either way a row's result does not depend on how many rows share the tile, the launch, or
// the pass. Every sum below is rounded step by step (`__fadd_rn`, `__fmaf_rn`): the compiler
// contracts nothing, so two kernels that add the same terms in the same order agree.

// MATVEC_TILE (TILE below), MATVEC_WARPS (WARPS), MMA_TILES, MMA_WARPS and MMA_UNROLL come
// from the host (mod.rs's `source`), which sizes the grids by them.
#define TILE MATVEC_TILE
#define WARPS MATVEC_WARPS
// (A pragma's argument is not macro-expanded; a constant is.)
constexpr int mma_unroll = MMA_UNROLL;

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

// One unit's products for one (feature, row) cell, from the unit's two half sums `lo` and
// `hi`, the sum `all` of the row's 32 values, and the row block's scale `d` and stored
// `sum`: every kernel's arithmetic, one way.
__device__ __forceinline__ float cell(const Unit& w, int lo, int hi, int all, float d, float sum) {
    float units = __fmul_rn(w.scale[0], (float)lo);
    units = __fmaf_rn(w.scale[1], (float)hi, units);
    units = __fmaf_rn(-w.offset, (float)all, units);
    return __fmaf_rn(d, units, -__fmul_rn(w.sum_offset, sum));
}

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
    return cell(w, lo, hi, all, x.d, x.sum);
}

// Each weight type reads a unit in two parts: `pair(i, lo, hi)` gives values 4i..4i + 3 and
// 16 + 4i..16 + 4i + 3 (i < 4) as ints of 4 signed bytes, `scales` the unit's factors. The
// warp-per-feature kernels take all four pairs of a unit in one lane; the tensor-core kernel
// gives each lane of a group one pair (the MMA's fragment layout).

// Q8_0: 34 bytes: f16 d, 32 int8.
struct Q8_0 {
    static constexpr int NUM = 34, DEN = 1;
    const u8* b;
    __device__ __forceinline__ Q8_0(const u8* row, int u) : b(row + (u64)u * 34) {}
    __device__ __forceinline__ void pair(int i, int& lo, int& hi) const {
        lo = load_2aligned(b + 2 + 4 * i);
        hi = load_2aligned(b + 18 + 4 * i);
    }
    __device__ __forceinline__ void scales(Unit& w) const {
        const float d = f16_to_f32(*(const u16*)b);
        w.scale[0] = w.scale[1] = d;
        w.offset = w.sum_offset = 0.0f;
    }
};

// Q5_0: 22 bytes: f16 d, u32 high bits, 16 bytes of low nibbles (values j and j + 16), each
// value minus 16. The 16 comes off as candle's kernel takes it off: times the activations'
// stored sum, so that both round alike.
struct Q5_0 {
    static constexpr int NUM = 22, DEN = 1;
    const u8* b;
    u32 qh;
    __device__ __forceinline__ Q5_0(const u8* row, int u)
        : b(row + (u64)u * 22), qh((u32)load_2aligned(b + 2)) {}
    __device__ __forceinline__ void pair(int i, int& lo, int& hi) const {
        const u32 lo4 = (u32)load_2aligned(b + 6 + 4 * i);
        u32 low = lo4 & 0x0F0F0F0F, high = (lo4 >> 4) & 0x0F0F0F0F;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            low |= ((qh >> (4 * i + j)) & 1) << (8 * j + 4);
            high |= ((qh >> (16 + 4 * i + j)) & 1) << (8 * j + 4);
        }
        lo = (int)low;
        hi = (int)high;
    }
    __device__ __forceinline__ void scales(Unit& w) const {
        const float d = f16_to_f32(*(const u16*)b);
        w.scale[0] = w.scale[1] = d;
        w.offset = 0.0f;
        w.sum_offset = 16.0f * d;
    }
};

// Q4_K: 144 bytes a 256-value block: f16 d, f16 dmin, 12 bytes of 6-bit scales and
// minimums, 128 bytes of nibbles (sub-block 2j in the low nibbles of bytes 32j..32j+31,
// 2j + 1 in their high nibbles). Unit u is sub-block u % 8 of block u / 8.
struct Q4_K {
    static constexpr int NUM = 144, DEN = 8;
    const u8* b;
    int s;
    __device__ __forceinline__ Q4_K(const u8* row, int u) : b(row + (u64)(u / 8) * 144), s(u % 8) {}
    __device__ __forceinline__ void pair(int i, int& lo, int& hi) const {
        const int* qs = (const int*)(b + 16 + 32 * (s / 2));
        const int shift = (s % 2) * 4;
        lo = (qs[i] >> shift) & 0x0F0F0F0F;
        hi = (qs[i + 4] >> shift) & 0x0F0F0F0F;
    }
    __device__ __forceinline__ void scales(Unit& w) const {
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
        w.scale[0] = w.scale[1] = d * (float)scale;
        w.offset = dmin * (float)minimum;
        w.sum_offset = 0.0f;
    }
};

// Q6_K: 210 bytes a 256-value block: 128 bytes of low nibbles, 64 of 2-bit high parts, 16
// int8 scales (one per 16 values), f16 d. Values 128h + 32g + l (h < 2, g < 4, l < 32) take
// the low (g < 2) or high nibble of byte 64h + 32(g % 2) + l, bits 2g of high byte 32h + l,
// and scale 8h + 2g + l / 16; each minus 32.
struct Q6_K {
    static constexpr int NUM = 210, DEN = 8;
    const u8* b;
    int h, g;
    __device__ __forceinline__ Q6_K(const u8* row, int u)
        : b(row + (u64)(u / 8) * 210), h(u % 8 / 4), g(u % 4) {}
    __device__ __forceinline__ int part(int i) const {
        const u8* ql = b + 64 * h + 32 * (g % 2);
        const u8* qh = b + 128 + 32 * h;
        const int shift = g < 2 ? 0 : 4;
        const u32 low = ((u32)load_2aligned(ql + 4 * i) >> shift) & 0x0F0F0F0F;
        const u32 high = (((u32)load_2aligned(qh + 4 * i) >> (2 * g)) & 0x03030303) << 4;
        return (int)__vsub4(low | high, 0x20202020);
    }
    __device__ __forceinline__ void pair(int i, int& lo, int& hi) const {
        lo = part(i);
        hi = part(i + 4);
    }
    __device__ __forceinline__ void scales(Unit& w) const {
        const signed char* sc = (const signed char*)(b + 192) + 8 * h + 2 * g;
        const float d = f16_to_f32(*(const u16*)(b + 208));
        w.scale[0] = d * (float)sc[0];
        w.scale[1] = d * (float)sc[1];
        w.offset = w.sum_offset = 0.0f;
    }
};

template <class T>
__device__ __forceinline__ void load_unit(const u8* row, int u, Unit& w) {
    const T unit(row, u);
#pragma unroll
    for (int i = 0; i < 4; ++i) unit.pair(i, w.q[i], w.q[i + 4]);
    unit.scales(w);
}

// The kernel for one weight type, F output features a warp. Grid (ceil(n / (WARPS * F)),
// ceil(rows / TILE)), WARPS warps a block. x: rows of x_blocks Q8_1 blocks; y: rows of n
// f32. A warp loads each activation block once for its F features, so F > 1 cuts the
// activation reads by F where many rows make them the bulk of the traffic; every (feature,
// row) sum is added in the same order whatever F, so both variants give the same bits.
template <class T, int F>
__device__ __forceinline__ void matvec_tiled(const u8* weight, const u8* x, float* y, int k,
                                             int n, int rows, int x_blocks) {
    const int lane = threadIdx.x % 32;
    const int f0 = (blockIdx.x * WARPS + threadIdx.x / 32) * F;
    const int first = blockIdx.y * TILE;
    if (f0 >= n) return;
    const int tile = min(TILE, rows - first);
    const int units = k / 32;
    const u64 row_bytes = (u64)units * T::NUM / T::DEN;
    float acc[F][TILE];
#pragma unroll
    for (int i = 0; i < F; ++i)
#pragma unroll
        for (int r = 0; r < TILE; ++r) acc[i][r] = 0.0f;
    for (int u = lane; u < units; u += 32) {
        Unit w[F];
        // Past the last feature a warp repeats it and writes nothing.
#pragma unroll
        for (int i = 0; i < F; ++i)
            load_unit<T>(weight + (u64)min(f0 + i, n - 1) * row_bytes, u, w[i]);
#pragma unroll
        for (int r = 0; r < TILE; ++r) {
            if (r < tile) {
                Q8Block xb;
                load_q8(x + ((u64)(first + r) * x_blocks + u) * Q8_1_BYTES, xb);
#pragma unroll
                for (int i = 0; i < F; ++i) acc[i][r] = __fadd_rn(acc[i][r], dot_unit(w[i], xb));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < F; ++i) {
#pragma unroll
        for (int r = 0; r < TILE; ++r) {
            float s = warp_sum(acc[i][r]);
            if (lane == 0 && r < tile && f0 + i < n) y[(u64)(first + r) * n + f0 + i] = s;
        }
    }
}

// c = a b for a 16 x 16 tile of int8 weights (lane 4g + t: a0 holds row g's columns 4t..4t + 3,
// a1 row g + 8's) and a 16 x 8 tile of int8 activations (b: column g's rows 4t..4t + 3): c0,
// c1 are row g's columns 2t and 2t + 1, c2, c3 row g + 8's. Integer sums: exact, so a cell
// does not depend on the other cells of the tile.
__device__ __forceinline__ void mma_s8(int (&c)[4], int a0, int a1, int b) {
#if defined(DUET_ON_CPU)
    emu::mma_m16n8k16_s8(c, a0, a1, b);
#elif __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
#else
    __trap();  // the host loads these kernels for sm_80 and later only
#endif
}

// The tensor-core kernel: a block takes 16 output features and up to NT tiles of 8 rows
// (NT: 1, 2, 4 or 8, the host's pick by rows, up to MMA_TILES), and part z = blockIdx.z of
// `split` equal runs of each row's units; its MMA_WARPS warps split the run (warp w: its
// units w, w + MMA_WARPS, ...). Per unit a warp's lanes load the 16 features' parts once,
// and each tile of rows costs two MMAs (values 0..15 and 16..31, whose scales differ in
// Q6_K). A cell adds its units' products in unit order within a warp, then the warps' sums
// in warp order, into y (split 1) or into part z of `partial` (rows x n floats a part),
// which `duet_matvec_combine` adds in part order: the same arithmetic for a row whatever
// rows share its tile, its block or its launch, and whatever NT (`split` depends on k
// alone). Grid (ceil(n / 16), ceil(rows / (8 NT)), split), 32 MMA_WARPS threads a block,
// dynamic shared memory for the warps' sums: MMA_WARPS NT 4 32 floats (matvec.rs's
// `mma_parts_bytes`; past 48 KB the host raises the kernel's limit).
template <class T, int NT>
__device__ __forceinline__ void matvec_mma(const u8* weight, const u8* x, float* y, int k, int n,
                                           int rows, int x_blocks, int split, float* partial) {
    DYNAMIC_SHARED(float, mma_shared);
    float(*parts)[NT][4][32] = (float(*)[NT][4][32])mma_shared;
    const unsigned all_lanes = 0xffffffff;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int f0 = blockIdx.x * 16;
    const int first = blockIdx.y * (8 * NT);
    const int tiles = min(NT, (rows - first + 7) / 8);
    const int units = k / 32;
    const u64 row_bytes = (u64)units * T::NUM / T::DEN;
    const int run = (units + split - 1) / split;
    const int last = min(units, (int)(blockIdx.z + 1) * run);
    // This lane's two features (past the last one, the last one again, never written).
    const u8* w0 = weight + (u64)min(f0 + g, n - 1) * row_bytes;
    const u8* w8 = weight + (u64)min(f0 + g + 8, n - 1) * row_bytes;
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
#pragma unroll mma_unroll
    for (int u = blockIdx.z * run + warp; u < last; u += MMA_WARPS) {
        const T unit0(w0, u), unit8(w8, u);
        int a_lo0, a_hi0, a_lo8, a_hi8;
        unit0.pair(t, a_lo0, a_hi0);
        unit8.pair(t, a_lo8, a_hi8);
        Unit s0, s8;
        unit0.scales(s0);
        unit8.scales(s8);
#pragma unroll
        for (int tile = 0; tile < NT; ++tile) {
            if (tile < tiles) {  // the same for the whole block: the shuffles see every lane
                // This lane's row (the MMA's column g), padding rows reading the last one.
                const int r = min(first + 8 * tile + g, rows - 1);
                const u8* xb = x + ((u64)r * x_blocks + u) * Q8_1_BYTES;
                const int b_lo = ((const int*)(xb + 4))[t], b_hi = ((const int*)(xb + 4))[4 + t];
                int lo[4], hi[4];
                mma_s8(lo, a_lo0, a_lo8, b_lo);
                mma_s8(hi, a_hi0, a_hi8, b_hi);
                // Row g's scale, stored sum and the sum of its 32 values (over the group).
                const float d = f16_to_f32(*(const u16*)xb);
                const float sum = f16_to_f32(*(const u16*)(xb + 2));
                int all = __dp4a(0x01010101, b_hi, __dp4a(0x01010101, b_lo, 0));
                all += __shfl_xor_sync(all_lanes, all, 1);
                all += __shfl_xor_sync(all_lanes, all, 2);
#pragma unroll
                for (int c = 0; c < 2; ++c) {  // this lane's cells' rows 2t + c: group 2t + c's
                    const int from = 4 * (2 * t + c);
                    const float rd = __shfl_sync(all_lanes, d, from);
                    const float rsum = __shfl_sync(all_lanes, sum, from);
                    const int rall = __shfl_sync(all_lanes, all, from);
                    acc[tile][c] = __fadd_rn(acc[tile][c], cell(s0, lo[c], hi[c], rall, rd, rsum));
                    acc[tile][2 + c] =
                        __fadd_rn(acc[tile][2 + c], cell(s8, lo[2 + c], hi[2 + c], rall, rd, rsum));
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) parts[warp][i][c][lane] = acc[i][c];
    __syncthreads();
    float* out = split > 1 ? partial + (u64)blockIdx.z * rows * n : y;
    for (int i = threadIdx.x; i < NT * 4 * 32; i += 32 * MMA_WARPS) {
        const int tile = i / 128, c = i / 32 % 4, l = i % 32;
        float s = parts[0][tile][c][l];
        for (int w = 1; w < MMA_WARPS; ++w) s = __fadd_rn(s, parts[w][tile][c][l]);
        const int f = f0 + l / 4 + 8 * (c / 2);
        const int row = first + 8 * tile + 2 * (l % 4) + c % 2;
        if (tile < tiles && f < n && row < rows) out[(u64)row * n + f] = s;
    }
}

// y = the `split` parts of `partial` (each `count` floats) added in part order.
extern "C" __global__ void duet_matvec_combine(const float* partial, float* y, int count,
                                               int split) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float s = partial[i];
    for (int z = 1; z < split; ++z) s = __fadd_rn(s, partial[(u64)z * count + i]);
    y[i] = s;
}

// The tensor-core kernel's sums for a tile of NR rows without tensor cores: the same cells
// (`cell` of the same integers and scales) added in the same order, so that a row's bits do
// not depend on which of the two kernels a pass takes, while a pass of one row or a few is
// not held to blocks of 16 features and 8 rows, most of them idle. A warp takes one output
// feature; its lanes in groups of FEW_LANES (1, 2 or 4, the host's) take a unit each, lane
// t of a group the unit's pairs t, t + FEW_LANES, ... (four lanes: pair t, as in the MMA's
// fragments), their integer sums added over the group (exact), and each unit's cell goes to
// shared memory. Then the warp adds them as the tensor-core kernel's blocks do: for part z
// of `split` and its warp w of MMA_WARPS, the units z run + w, + MMA_WARPS, ... from zero in
// order; a part, its warps' sums in warp order; the row, its parts in part order. Grid
// (ceil(n / warps), ceil(rows / NR)), `warps` = blockDim.x / 32; dynamic shared memory:
// `warps NR (units + split (MMA_WARPS + 1))` floats (matvec.rs's `few_floats`).
template <class T, int NR>
__device__ __forceinline__ void matvec_few(const u8* weight, const u8* x, float* y, int k, int n,
                                           int rows, int x_blocks, int split) {
    DYNAMIC_SHARED(float, few_shared);
    constexpr int lanes = FEW_LANES, pairs = 4 / FEW_LANES;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / lanes, t = lane % lanes;
    const unsigned group = ((1u << lanes) - 1) << (lanes * g);
    const int f = blockIdx.x * (blockDim.x / 32) + warp;
    const int first = blockIdx.y * NR;
    const int tile = min(NR, rows - first);
    const int units = k / 32, sets = split * MMA_WARPS;
    const int run = (units + split - 1) / split;
    // A row's cells, then its (part, warp) sets' sums, then its parts'.
    const int stride = units + sets + split;
    float* cells = few_shared + (u64)warp * NR * stride;
    if (f >= n) return;  // the whole warp: nothing below waits for the block
    const u8* w = weight + (u64)f * ((u64)units * T::NUM / T::DEN);
#pragma unroll 2
    for (int u = g; u < units; u += 32 / lanes) {
        const T unit(w, u);
        int a_lo[pairs], a_hi[pairs];
#pragma unroll
        for (int j = 0; j < pairs; ++j) unit.pair(t + lanes * j, a_lo[j], a_hi[j]);
        Unit s;
        unit.scales(s);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            if (r < tile) {
                const u8* xb = x + ((u64)(first + r) * x_blocks + u) * Q8_1_BYTES;
                const int* b = (const int*)(xb + 4);
                int lo = 0, hi = 0, all = 0;
#pragma unroll
                for (int j = 0; j < pairs; ++j) {
                    const int b_lo = b[t + lanes * j], b_hi = b[4 + t + lanes * j];
                    lo = __dp4a(a_lo[j], b_lo, lo);
                    hi = __dp4a(a_hi[j], b_hi, hi);
                    all = __dp4a(0x01010101, b_hi, __dp4a(0x01010101, b_lo, all));
                }
#pragma unroll
                for (int m = 1; m < lanes; m *= 2) {  // integers: exact in any order
                    lo += __shfl_xor_sync(group, lo, m);
                    hi += __shfl_xor_sync(group, hi, m);
                    all += __shfl_xor_sync(group, all, m);
                }
                if (t == 0) {
                    const float d = f16_to_f32(*(const u16*)xb);
                    const float sum = f16_to_f32(*(const u16*)(xb + 2));
                    cells[r * stride + u] = cell(s, lo, hi, all, d, sum);
                }
            }
        }
    }
    __syncwarp();
    for (int i = lane; i < tile * sets; i += 32) {
        const int r = i / sets, set = i % sets;
        const int z = set / MMA_WARPS, last = min(units, (z + 1) * run);
        float acc = 0.0f;
        for (int u = z * run + set % MMA_WARPS; u < last; u += MMA_WARPS)
            acc = __fadd_rn(acc, cells[r * stride + u]);
        cells[r * stride + units + set] = acc;
    }
    __syncwarp();
    for (int i = lane; i < tile * split; i += 32) {
        const int r = i / split, z = i % split;
        const float* acc = cells + r * stride + units + z * MMA_WARPS;
        float s = acc[0];
        for (int v = 1; v < MMA_WARPS; ++v) s = __fadd_rn(s, acc[v]);
        cells[r * stride + units + sets + z] = s;
    }
    __syncwarp();
    if (lane < tile) {
        const float* part = cells + lane * stride + units + sets;
        float s = part[0];
        for (int z = 1; z < split; ++z) s = __fadd_rn(s, part[z]);
        y[(u64)(first + lane) * n + f] = s;
    }
}

#define FEW_KERNEL(TYPE, NAME, NR)                                                             \
    extern "C" __global__ void duet_matvec_##NAME##_few##NR(const u8* weight, const u8* x,    \
                                                            float* y, int k, int n, int rows,  \
                                                            int x_blocks, int split) {         \
        matvec_few<TYPE, NR>(weight, x, y, k, n, rows, x_blocks, split);                        \
    }

#define MMA_KERNEL(TYPE, NAME, NT)                                                             \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)                               \
        duet_matvec_##NAME##_mma##NT(const u8* weight, const u8* x, float* y, int k, int n,    \
                                     int rows, int x_blocks, int split, float* partial) {      \
        matvec_mma<TYPE, NT>(weight, x, y, k, n, rows, x_blocks, split, partial);               \
    }

#define KERNELS(TYPE, NAME)                                                                    \
    extern "C" __global__ void duet_matvec_##NAME(const u8* weight, const u8* x, float* y,     \
                                                  int k, int n, int rows, int x_blocks) {      \
        matvec_tiled<TYPE, 1>(weight, x, y, k, n, rows, x_blocks);                              \
    }                                                                                          \
    extern "C" __global__ void duet_matvec_##NAME##_x4(const u8* weight, const u8* x, float* y, \
                                                       int k, int n, int rows, int x_blocks) { \
        matvec_tiled<TYPE, 4>(weight, x, y, k, n, rows, x_blocks);                              \
    }

KERNELS(Q8_0, q8_0)
KERNELS(Q5_0, q5_0)
KERNELS(Q4_K, q4_k)
KERNELS(Q6_K, q6_k)

// The tensor-core kernels for the block shapes the host may pick (up to MMA_TILES tiles,
// whose partial sums it checked fit the shared memory).
#define MMA_KERNELS(NT)                                                                        \
    MMA_KERNEL(Q8_0, q8_0, NT)                                                                 \
    MMA_KERNEL(Q5_0, q5_0, NT)                                                                 \
    MMA_KERNEL(Q4_K, q4_k, NT)                                                                 \
    MMA_KERNEL(Q6_K, q6_k, NT)

MMA_KERNELS(1)
#if MMA_TILES >= 2
MMA_KERNELS(2)
#endif
#if MMA_TILES >= 4
MMA_KERNELS(4)
#endif
#if MMA_TILES >= 8
MMA_KERNELS(8)
#endif

// The few-row kernels, by rows a tile (1, 2, 4, 8, up to the host's FEW_ROWS).
#define FEW_KERNELS(NR)                                                                        \
    FEW_KERNEL(Q8_0, q8_0, NR)                                                                 \
    FEW_KERNEL(Q5_0, q5_0, NR)                                                                 \
    FEW_KERNEL(Q4_K, q4_k, NR)                                                                 \
    FEW_KERNEL(Q6_K, q6_k, NR)

#if FEW_ROWS >= 1
FEW_KERNELS(1)
#endif
#if FEW_ROWS >= 2
FEW_KERNELS(2)
#endif
#if FEW_ROWS >= 3
FEW_KERNELS(4)
#endif
#if FEW_ROWS >= 5
FEW_KERNELS(8)
#endif
