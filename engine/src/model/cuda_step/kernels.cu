// The CUDA step's own kernels (compiled by NVRTC at first use, after common.cuh; see mod.rs).
//
// Every kernel here computes a row of the batch from that row's inputs alone, in a fixed
// order of operations, and reads what changes from step to step (positions, which cache a
// row writes) from device memory: a step's launches then never change, so they can be
// captured once into a CUDA graph and replayed.
//
// Activations for the quantized mat-vec kernels are written as Q8_1 blocks: 32 values as
// int8 with an f16 scale and the f16 sum of the values (the layout candle's mat-vec kernels
// read), quantized by one warp per block.

// NORM_THREADS, ATTN_THREADS, ATTN_PARTS, ATTN_CHUNK and GREEDY_THREADS come from the host
// (mod.rs's `source`), which launches and sizes buffers by them.

// The warp's 32 values (one per lane) as one Q8_1 block at `block`.
__device__ __forceinline__ void store_q8_1(unsigned char* block, float v) {
    const int lane = threadIdx.x % 32;
    const float amax = warp_max(fabsf(v));
    const float sum = warp_sum(v);
    const float d = amax / 127.0f;
    const signed char q = amax == 0.0f ? 0 : (signed char)roundf(v / d);
    block[4 + lane] = (unsigned char)q;
    if (lane == 0) {
        u16* ds = (u16*)block;
        ds[0] = f32_to_f16_bits(d);
        ds[1] = f32_to_f16_bits(sum);
    }
}

// One block per row: x += delta (when given; x is the residual stream, updated in place),
// then y = x * rsqrt(mean(x^2) + eps) * w, written as Q8_1 (n / 32 blocks of the row's
// row_blocks; the padding blocks past n stay zero) and, when `y_f32` is given, as f32.
extern "C" __global__ void duet_add_norm_q8(float* x, const float* delta, const float* w,
                                            unsigned char* q, float* y_f32, int n,
                                            int row_blocks, float eps) {
    __shared__ float scratch[NORM_THREADS / 32];
    const int row = blockIdx.x;
    float* xr = x + (u64)row * n;
    float local = 0.0f;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) {
        float v = xr[i];
        if (delta != nullptr) {
            v += delta[(u64)row * n + i];
            xr[i] = v;
        }
        local = fmaf(v, v, local);
    }
    const float total = block_reduce<NORM_THREADS>(local, scratch, false);
    const float scale = rsqrtf(total / (float)n + eps);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int b = warp; b < n / 32; b += NORM_THREADS / 32) {
        const int i = b * 32 + lane;
        const float y = xr[i] * scale * w[i];
        if (y_f32 != nullptr) y_f32[(u64)row * n + i] = y;
        store_q8_1(q + ((u64)row * row_blocks + b) * Q8_1_BYTES, y);
    }
}

// In a grid of (ceil(n / 32 / 8), rows) blocks of 8 warps: the Q8_1 block of a row's n
// values this warp writes, or -1 past the last.
__device__ __forceinline__ int warp_q8_block(int n) {
    const int b = blockIdx.x * 8 + threadIdx.x / 32;
    return b < n / 32 ? b : -1;
}

// silu(gate) * up as Q8_1: grid (ceil(n / 32 / 8), rows), 8 warps a block, a warp a Q8_1
// block. Row r's gate and up values start at gate + r * gate_stride and up + r * up_stride
// (one launch may have computed both, side by side in each row).
extern "C" __global__ void duet_silu_mul_q8(const float* gate, const float* up,
                                            unsigned char* q, int n, int row_blocks,
                                            int gate_stride, int up_stride) {
    const int row = blockIdx.y, b = warp_q8_block(n);
    if (b < 0) return;
    const int i = b * 32 + threadIdx.x % 32;
    const float g = gate[(u64)row * gate_stride + i];
    const float v = g / (1.0f + expf(-g)) * up[(u64)row * up_stride + i];
    store_q8_1(q + ((u64)row * row_blocks + b) * Q8_1_BYTES, v);
}

// The row's cache of `layer`: kv[(row * layers + layer) * 2 + {0: keys, 1: values}], each
// [capacity, kv_heads, hd] f32.
__device__ __forceinline__ float* cache_of(const u64* kv, int row, int layer, int layers,
                                           int which) {
    return (float*)kv[((u64)row * layers + layer) * 2 + which];
}

// Bias, the head's RMS norm where the model has one (`q_norm`, `k_norm`: Qwen3's, hd
// weights each, shared by the heads; eps), and rotary embedding for one row's heads at its
// position, then the row's keys and values into its cache at its slot (a chain's row: its
// position; a tree's: its index past the cache, where the tree's tokens sit in order).
// Grid (heads + kv_heads, rows), hd / 2 threads, one per rotated pair: (2i, 2i + 1) when
// `interleaved` (GGUF llama), else (i, i + hd / 2) (qwen2, qwen3). Row r's projections
// start at q_in + r * q_stride (k_in, v_in likewise): one launch may have computed several
// of them, side by side in each row.
extern "C" __global__ void duet_rope_append(const float* q_in, const float* k_in,
                                            const float* v_in, const float* q_bias,
                                            const float* k_bias, const float* v_bias,
                                            const float* cos_table, const float* sin_table,
                                            const u32* positions, const u32* slots,
                                            const u64* kv, int layer, int layers, float* q_out,
                                            int heads, int kv_heads, int hd, int interleaved,
                                            int q_stride, int k_stride, int v_stride,
                                            const float* q_norm, const float* k_norm,
                                            float eps) {
    const int row = blockIdx.y, head = blockIdx.x, i = threadIdx.x, half = hd / 2;
    const u32 pos = positions[row];
    const float c = cos_table[(u64)pos * half + i], s = sin_table[(u64)pos * half + i];
    const int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    const float* src;
    const float* bias;
    float* dst;
    if (head < heads) {
        src = q_in + (u64)row * q_stride + head * hd;
        bias = q_bias == nullptr ? nullptr : q_bias + head * hd;
        dst = q_out + ((u64)row * heads + head) * hd;
    } else {
        const int kh = head - heads;
        const u64 at = ((u64)slots[row] * kv_heads + kh) * hd;
        src = k_in + (u64)row * k_stride + kh * hd;
        bias = k_bias == nullptr ? nullptr : k_bias + kh * hd;
        dst = cache_of(kv, row, layer, layers, 0) + at;
        // Values are not rotated: copy this thread's two of them.
        const float* v = v_in + (u64)row * v_stride + kh * hd;
        float* v_dst = cache_of(kv, row, layer, layers, 1) + at;
        const float* vb = v_bias == nullptr ? nullptr : v_bias + kh * hd;
        v_dst[a] = v[a] + (vb == nullptr ? 0.0f : vb[a]);
        v_dst[b] = v[b] + (vb == nullptr ? 0.0f : vb[b]);
    }
    float x0 = src[a] + (bias == nullptr ? 0.0f : bias[a]);
    float x1 = src[b] + (bias == nullptr ? 0.0f : bias[b]);
    const float* norm = head < heads ? q_norm : k_norm;
    if (norm != nullptr) {
        // The same for every thread of the block (one head): each leaves its pair's
        // squares, and one thread adds them in pair order, whatever rows share the launch.
        __shared__ float squares[ATTN_THREADS / 2];
        __shared__ float scale;
        squares[i] = fmaf(x1, x1, x0 * x0);
        __syncthreads();
        if (i == 0) {
            float total = 0.0f;
            for (int j = 0; j < half; ++j) total += squares[j];
            scale = rsqrtf(total / (float)hd + eps);
        }
        __syncthreads();
        x0 = x0 * scale * norm[a];
        x1 = x1 * scale * norm[b];
    }
    dst[a] = x0 * c - x1 * s;
    dst[b] = x0 * s + x1 * c;
}

// The cache row of a row's `j`th key: the first `prefix` keys are the cache's rows in order;
// a tree's row goes on along its path, the slots of its ancestors past the cache and its
// own (`tail`, TREE_PATH a row). The same tokens fed as a chain meet the same keys in the
// same order, so a tree's row has the arithmetic of its path's last row as a chain.
__device__ __forceinline__ u64 key_row(int j, u32 prefix, const u32* tail) {
    return (u32)j < prefix ? (u64)j : (u64)tail[j - prefix];
}

// Causal attention, split over the keys: a row's keys 0..=pos (`key_row`) fall into
// chunks of ATTN_CHUNK keys, chunk c to part c % ATTN_PARTS, one block per (head, row,
// part); a part runs the online softmax over its chunks in order and leaves its maximum,
// sum and weighted values in `parts` ([rows, heads, ATTN_PARTS, 2 + hd] f32), and
// duet_attend_combine_q8 adds the parts in part order. A chunk's scores take a warp a key,
// each lane a strided share of the dimensions and a fixed butterfly over the lanes. How a
// row's keys split depends on its position alone, so its result does not depend on the
// rows launched with it, and a long cache keeps many blocks busy (up to ATTN_PARTS a row
// and head), where one block a row and head walked it alone.
extern "C" __global__ void duet_attend_parts(const float* q, const u64* kv, const u32* positions,
                                             const u32* prefixes, const u32* paths, int layer,
                                             int layers, float* parts, int heads, int kv_heads,
                                             int hd, float scale) {
    __shared__ float query[ATTN_THREADS];
    __shared__ float scores[ATTN_CHUNK];
    __shared__ float probs[ATTN_CHUNK];
    const int head = blockIdx.x, row = blockIdx.y, part = blockIdx.z, t = threadIdx.x;
    const int warp = t / 32, lane = t % 32;
    const int n = (int)positions[row] + 1;
    if (part * ATTN_CHUNK >= n) return;
    const u32 prefix = prefixes[row];
    const u32* tail = paths + (u64)row * TREE_PATH;
    const int kv_head = head / (heads / kv_heads);
    const u64 stride = (u64)kv_heads * hd;
    const float* keys = cache_of(kv, row, layer, layers, 0) + (u64)kv_head * hd;
    const float* values = cache_of(kv, row, layer, layers, 1) + (u64)kv_head * hd;
    if (t < hd) query[t] = q[((u64)row * heads + head) * hd + t];
    __syncthreads();

    float running_max = __int_as_float(0xff800000);  // -inf
    float running_sum = 0.0f, acc = 0.0f;
    for (int base = part * ATTN_CHUNK; base < n; base += ATTN_PARTS * ATTN_CHUNK) {
        const int m = min(ATTN_CHUNK, n - base);
        for (int j = warp; j < m; j += ATTN_THREADS / 32) {
            const float* key = keys + key_row(base + j, prefix, tail) * stride;
            float dot = 0.0f;
            for (int d = lane; d < hd; d += 32) dot = fmaf(query[d], key[d], dot);
            dot = warp_sum(dot);
            if (lane == 0) scores[j] = dot * scale;
        }
        __syncthreads();
        float chunk_max = scores[0];
        for (int j = 1; j < m; ++j) chunk_max = fmaxf(chunk_max, scores[j]);
        const float new_max = fmaxf(running_max, chunk_max);
        if (t < m) probs[t] = expf(scores[t] - new_max);
        __syncthreads();
        float chunk_sum = 0.0f;
        for (int j = 0; j < m; ++j) chunk_sum += probs[j];
        const float correction = expf(running_max - new_max);
        running_sum = running_sum * correction + chunk_sum;
        running_max = new_max;
        if (t < hd) {
            float a = acc * correction;
            for (int j = 0; j < m; ++j) {
                a = fmaf(probs[j], values[key_row(base + j, prefix, tail) * stride + t], a);
            }
            acc = a;
        }
        __syncthreads();
    }
    float* out = parts + (((u64)row * heads + head) * ATTN_PARTS + part) * (2 + hd);
    if (t == 0) {
        out[0] = running_max;
        out[1] = running_sum;
    }
    if (t < hd) out[2 + t] = acc;
}

// duet_attend_parts for the query heads that share a kv head (grouped-query attention), one
// block per (kv head, row, part): each chunk's keys and values are read once for the group,
// not once a head. Each head's dot products, softmax and weighted sums run as in
// duet_attend_parts, in the same order, so its parts come out bit for bit the same.
extern "C" __global__ void duet_attend_parts_grouped(const float* q, const u64* kv,
                                                     const u32* positions, const u32* prefixes,
                                                     const u32* paths, int layer, int layers,
                                                     float* parts, int heads, int kv_heads,
                                                     int hd, float scale) {
    __shared__ float query[ATTN_GROUP_MAX][ATTN_THREADS];
    __shared__ float scores[ATTN_GROUP_MAX][ATTN_CHUNK];
    __shared__ float probs[ATTN_GROUP_MAX][ATTN_CHUNK];
    const int kv_head = blockIdx.x, row = blockIdx.y, part = blockIdx.z, t = threadIdx.x;
    const int warp = t / 32, lane = t % 32, group = heads / kv_heads;
    const int n = (int)positions[row] + 1;
    if (part * ATTN_CHUNK >= n) return;
    const u32 prefix = prefixes[row];
    const u32* tail = paths + (u64)row * TREE_PATH;
    const u64 stride = (u64)kv_heads * hd;
    const float* keys = cache_of(kv, row, layer, layers, 0) + (u64)kv_head * hd;
    const float* values = cache_of(kv, row, layer, layers, 1) + (u64)kv_head * hd;
    const u64 first = (u64)row * heads + (u64)kv_head * group;
    for (int g = 0; g < group; ++g) {
        if (t < hd) query[g][t] = q[(first + g) * hd + t];
    }
    __syncthreads();

    float running_max[ATTN_GROUP_MAX], running_sum[ATTN_GROUP_MAX], acc[ATTN_GROUP_MAX];
#pragma unroll
    for (int g = 0; g < ATTN_GROUP_MAX; ++g) {
        running_max[g] = __int_as_float(0xff800000);  // -inf
        running_sum[g] = 0.0f;
        acc[g] = 0.0f;
    }
    for (int base = part * ATTN_CHUNK; base < n; base += ATTN_PARTS * ATTN_CHUNK) {
        const int m = min(ATTN_CHUNK, n - base);
        for (int w = warp; w < group * m; w += ATTN_THREADS / 32) {
            const int g = w / m, j = w % m;
            const float* key = keys + key_row(base + j, prefix, tail) * stride;
            float dot = 0.0f;
            for (int d = lane; d < hd; d += 32) dot = fmaf(query[g][d], key[d], dot);
            dot = warp_sum(dot);
            if (lane == 0) scores[g][j] = dot * scale;
        }
        __syncthreads();
        float correction[ATTN_GROUP_MAX];
#pragma unroll
        for (int g = 0; g < ATTN_GROUP_MAX; ++g) {
            if (g >= group) break;
            float chunk_max = scores[g][0];
            for (int j = 1; j < m; ++j) chunk_max = fmaxf(chunk_max, scores[g][j]);
            const float new_max = fmaxf(running_max[g], chunk_max);
            if (t < m) probs[g][t] = expf(scores[g][t] - new_max);
            correction[g] = expf(running_max[g] - new_max);
            running_max[g] = new_max;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < ATTN_GROUP_MAX; ++g) {
            if (g >= group) break;
            float chunk_sum = 0.0f;
            for (int j = 0; j < m; ++j) chunk_sum += probs[g][j];
            running_sum[g] = running_sum[g] * correction[g] + chunk_sum;
            acc[g] *= correction[g];
        }
        if (t < hd) {
            for (int j = 0; j < m; ++j) {
                const float v = values[key_row(base + j, prefix, tail) * stride + t];
#pragma unroll
                for (int g = 0; g < ATTN_GROUP_MAX; ++g) {
                    if (g < group) acc[g] = fmaf(probs[g][j], v, acc[g]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int g = 0; g < ATTN_GROUP_MAX; ++g) {
        if (g >= group) break;
        float* out = parts + ((first + g) * ATTN_PARTS + part) * (2 + hd);
        if (t == 0) {
            out[0] = running_max[g];
            out[1] = running_sum[g];
        }
        if (t < hd) out[2 + t] = acc[g];
    }
}

// The parts of duet_attend_parts into each row's attention output as Q8_1 (the input of
// the output projection), laid out as duet_silu_mul_q8: a warp a Q8_1 block of n = heads *
// hd values, a lane a value, which adds the parts its row's keys reached in part order.
extern "C" __global__ void duet_attend_combine_q8(const float* parts, const u32* positions,
                                                  unsigned char* q, int n, int row_blocks,
                                                  int heads, int hd) {
    const int row = blockIdx.y, b = warp_q8_block(n);
    if (b < 0) return;
    const int feature = b * 32 + threadIdx.x % 32;
    const int head = feature / hd, d = feature % hd;
    const int keys = (int)positions[row] + 1;
    const int used = min(ATTN_PARTS, (keys + ATTN_CHUNK - 1) / ATTN_CHUNK);
    const float* p = parts + ((u64)row * heads + head) * ATTN_PARTS * (2 + hd);
    float top = p[0];
    for (int z = 1; z < used; ++z) top = fmaxf(top, p[z * (2 + hd)]);
    float sum = 0.0f, acc = 0.0f;
    for (int z = 0; z < used; ++z) {
        const float* part = p + z * (2 + hd);
        const float w = expf(part[0] - top);
        sum = fmaf(w, part[1], sum);
        acc = fmaf(w, part[2 + d], acc);
    }
    store_q8_1(q + ((u64)row * row_blocks + b) * Q8_1_BYTES, acc / sum);
}

// Each row's greedy summary, one block per row of n logits: the index of its largest logit
// (the lowest among equal ones; NaN never wins, -inf is never chosen; -1 when none is
// usable), that logit, and the sum of exp(x - max) over the logits within 24 of it (of +inf
// maxima: how many there are), as out[row] = {index's bits, max, sum}. Fixed reduction
// trees: a row's summary does not depend on the rows beside it.
extern "C" __global__ void duet_greedy(const float* logits, int n, float* out) {
    __shared__ float scratch[GREEDY_THREADS / 32];
    __shared__ float warp_best[GREEDY_THREADS / 32];
    __shared__ int warp_index[GREEDY_THREADS / 32];
    const int row = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32;
    const float* x = logits + (u64)row * n;
    float best = __int_as_float(0xff800000);  // -inf
    int index = -1;
    for (int i = t; i < n; i += GREEDY_THREADS) {
        const float v = x[i];
        if (v > best) {
            best = v;
            index = i;
        }
    }
    // (best, index) pairs: the larger value, on a tie the lower valid index.
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffff, best, o);
        const int other_index = __shfl_xor_sync(0xffffffff, index, o);
        if (other_index >= 0 &&
            (index < 0 || other > best || (other == best && other_index < index))) {
            best = other;
            index = other_index;
        }
    }
    if (lane == 0) {
        warp_best[warp] = best;
        warp_index[warp] = index;
    }
    __syncthreads();
    best = warp_best[0];
    index = warp_index[0];
    for (int w = 1; w < GREEDY_THREADS / 32; ++w) {
        if (warp_index[w] >= 0 &&
            (index < 0 || warp_best[w] > best || (warp_best[w] == best && warp_index[w] < index))) {
            best = warp_best[w];
            index = warp_index[w];
        }
    }
    const bool infinite = best == __int_as_float(0x7f800000);
    const float floor = best - 24.0f;
    float local = 0.0f;
    if (index >= 0) {
        for (int i = t; i < n; i += GREEDY_THREADS) {
            const float v = x[i];
            if (infinite) local += v == best ? 1.0f : 0.0f;
            else if (v > floor) local += expf(v - best);
        }
    }
    const float sum = block_reduce<GREEDY_THREADS>(local, scratch, false);
    if (t == 0) {
        out[(u64)row * 3] = __int_as_float(index);
        out[(u64)row * 3 + 1] = best;
        out[(u64)row * 3 + 2] = sum;
    }
}

// Each thread's `mine` (of its run of ids; the runs in id order) as the sum over the runs
// before it, in before[thread], and over them all in before[GREEDY_THREADS]: warp 0 scans
// them, each lane its own runs in order, the lanes' sums across the warp.
template <typename T>
__device__ void runs_before(T mine, T* before) {
    const int t = threadIdx.x;
    __syncthreads();
    before[t] = mine;
    __syncthreads();
    if (t < 32) {
        const int per_lane = GREEDY_THREADS / 32, first = t * per_lane;
        T part = 0;
        for (int r = first; r < first + per_lane; ++r) part += before[r];
        T through = part;
        for (int o = 1; o < 32; o <<= 1) {
            const T lower = __shfl_up_sync(0xffffffff, through, o);
            if (t >= o) through += lower;
        }
        T at = __shfl_up_sync(0xffffffff, through, 1);
        if (t == 0) at = 0;
        for (int r = first; r < first + per_lane; ++r) {
            const T next = at + before[r];
            before[r] = at;
            at = next;
        }
        if (t == 31) before[GREEDY_THREADS] = through;
    }
    __syncthreads();
}

// A row being drawn from (duet_draw): its logits, the largest, the settings that weigh it,
// and the run of ids this thread takes.
struct DrawRow {
    const float* x;
    float top, temperature, min_p;
    int begin, end;
};

// A cut of a row's weights (top-k's, top-p's): those above `least` stay, and of those equal
// to it the first `ties` in id order; least 0 keeps every positive weight.
struct Cut {
    float least;
    int ties;
};

// exp((x - top) / temperature), 0 for non-finite logits, below f32's normal range or under
// min_p (the largest weighs 1): sampling.rs's weights.
__device__ __forceinline__ float base_weight(const DrawRow& r, int i) {
    const float w = expf((r.x[i] - r.top) / r.temperature);
    return (w >= 1.17549435e-38f && w >= r.min_p) ? w : 0.0f;
}

// `w` after `cut`, where `*rank` counts the weights equal to its boundary before this one.
__device__ __forceinline__ float after(float w, Cut cut, int* rank) {
    if (w > cut.least) return w;
    if (w > 0.0f && w == cut.least) return (*rank)++ < cut.ties ? w : 0.0f;
    return 0.0f;
}

// Id i's weight after the top-k cut, then the top-p cut; ranks: each cut's ties before it.
// Called for a thread's ids in order, from the ranks its run starts with.
__device__ __forceinline__ float weight(const DrawRow& r, int i, const Cut* cuts, int* ranks) {
    return after(after(base_weight(r, i), cuts[0], &ranks[0]), cuts[1], &ranks[1]);
}

// Calls f(i, w) for each id i of this thread's run, in order, with its weight w after both
// cuts, each cut's ties ranked from those before the run (`starts`): one walk over the run.
template <class F>
__device__ __forceinline__ void walk(const DrawRow& r, const Cut* cuts, const int* starts, F f) {
    int ranks[2] = {starts[0], starts[1]};
    for (int i = r.begin; i < r.end; ++i) f(i, weight(r, i, cuts, ranks));
}

// What duet_draw's steps share: reductions' scratch, the digit search's buckets and state,
// and each cut's ties before each run.
struct DrawShared {
    float scratch[GREEDY_THREADS / 32];
    int int_scratch[GREEDY_THREADS / 32];
    double scratch64[GREEDY_THREADS / 32];
    unsigned long long hist[2048];
    unsigned long long need;
    int digit;
    int ties_before[2][GREEDY_THREADS + 1];
};

// Warp 0's search of least_reaching's buckets (`bins` of them in s->hist) from the top down
// for the first whose sum with those above reaches s->need: its digit and what is left to
// reach in it, into s; where none does, the lowest bucket with any (after the first pass),
// the need less all of them; -1 where there is none.
__device__ void descend(int bins, bool first_pass, DrawShared* s) {
    const int t = threadIdx.x, per = bins / 32, high = bins - t * per;
    const unsigned long long want = s->need;
    unsigned long long part = 0, left = 0;
    int lowest = -1, digit = -1;
    for (int b = high - 1; b >= high - per; --b) {
        part += s->hist[b];
        if (s->hist[b] > 0) lowest = b;
    }
    unsigned long long through = part;
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long upper = __shfl_up_sync(0xffffffff, through, o);
        if (t >= o) through += upper;
    }
    unsigned long long above = through - part;
    for (int b = high - 1; b >= high - per && digit < 0; --b) {
        if (s->hist[b] > 0 && above + s->hist[b] >= want) {
            digit = b;
            left = want - above;
        }
        above += s->hist[b];
    }
    const unsigned reached = __ballot_sync(0xffffffff, digit >= 0);
    const unsigned nonempty = __ballot_sync(0xffffffff, lowest >= 0);
    const unsigned long long total = __shfl_sync(0xffffffff, through, 31);
    if (reached) {
        const int lane = __ffs(reached) - 1;
        digit = __shfl_sync(0xffffffff, digit, lane);
        left = __shfl_sync(0xffffffff, left, lane);
    } else {
        // Short of it in a lower pass (rounding): the bucket's least weight.
        const int lane = 31 - __clz(nonempty);
        digit = nonempty && !first_pass ? __shfl_sync(0xffffffff, lowest, lane) : -1;
        left = want > total ? want - total : 0;
    }
    if (t == 0) {
        s->digit = digit;
        s->need = left;
    }
}

// The largest weight w (after `cuts`) for which the weights of at least w reach `need`,
// each counting 1 (`by_mass` false) or its weight in units of 2^-40: sampling.rs's
// `least_reaching`, its bits found 11, 10 and 10 at a time. 0 where the whole row falls
// short of `need`.
__device__ float least_reaching(const DrawRow& r, const Cut* cuts, const int* starts,
                                bool by_mass, unsigned long long need, DrawShared* s) {
    const int t = threadIdx.x;
    const int shifts[3] = {20, 10, 0}, widths[3] = {11, 10, 10};
    u32 prefix = 0;
    if (t == 0) s->need = need;
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = shifts[pass], bins = 1 << widths[pass];
        __syncthreads();
        for (int b = t; b < bins; b += GREEDY_THREADS) s->hist[b] = 0;
        __syncthreads();
        walk(r, cuts, starts, [&](int, float w) {
            const u32 bits = __float_as_uint(w);
            if (w > 0.0f && (bits >> (shift + widths[pass])) == prefix) {
                const unsigned long long count =
                    by_mass ? (unsigned long long)((double)w * 1099511627776.0) : 1ull;
                atomicAdd(&s->hist[(bits >> shift) & (bins - 1)], count);
            }
        });
        __syncthreads();
        if (t < 32) descend(bins, pass == 0, s);
        __syncthreads();
        if (s->digit < 0) return 0.0f;
        prefix = (prefix << widths[pass]) | (u32)s->digit;
    }
    return __uint_as_float(prefix);
}

// The top-k cut (top_k > 0), then the top-p cut (top_p < 1), of a row's weights, each at
// the boundary the host's sampler finds (keep_top_k, keep_nucleus): cuts[0] and cuts[1], and
// each cut's ties before this thread's run in starts.
__device__ void find_cuts(const DrawRow& r, int top_k, float top_p, Cut* cuts, int* starts,
                          DrawShared* s) {
    const int t = threadIdx.x;
    if (top_k > 0) {
        const float least = least_reaching(r, cuts, starts, false, (u64)top_k, s);
        if (least > 0.0f) {
            int above = 0, tied = 0;
            walk(r, cuts, starts, [&](int, float w) {
                above += w > least;
                tied += w == least;
            });
            cuts[0] = {least, top_k - block_sum<GREEDY_THREADS>(above, s->int_scratch)};
            runs_before(tied, s->ties_before[0]);
            starts[0] = s->ties_before[0][t];
        }
    }
    if (top_p < 1.0f) {
        double mine = 0.0;
        walk(r, cuts, starts, [&](int, float w) { mine += (double)w; });
        const double target = (double)top_p * block_sum<GREEDY_THREADS>(mine, s->scratch64);
        const double need = ceil(target * 1099511627776.0);
        const float least =
            least_reaching(r, cuts, starts, true, need < 1.0 ? 1ull : (u64)need, s);
        if (least > 0.0f) {
            double above = 0.0;
            int tied = 0;
            walk(r, cuts, starts, [&](int, float w) {
                if (w > least) above += (double)w;
                tied += w == least;
            });
            above = block_sum<GREEDY_THREADS>(above, s->scratch64);
            cuts[1] = {least, (int)fmax(1.0, ceil((target - above) / (double)least))};
            runs_before(tied, s->ties_before[1]);
            starts[1] = s->ties_before[1][t];
        }
    }
}

// A rejected draft (`exclude` >= 0) and the distribution it was drawn from: `len` entries of
// ids in ascending order and their probabilities (0 entries: a point mass on it, a
// lookup's); `rest`: its residual's total once known (0: none yet, or none left).
struct Residual {
    int exclude;
    const u32* ids;
    const float* probs;
    int len;
    double rest;
};

// The first of the residual's entries at or after id `i` (where a thread's walk starts).
__device__ __forceinline__ int entry_from(const Residual& res, int i) {
    int lo = 0, hi = res.len;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if ((int)res.ids[mid] < i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Id i's share of the residual, max(0, p - q) in f64 (verify.rs's `residual`), for ids
// visited in ascending order from the entry `*at` (advanced past them).
__device__ __forceinline__ double residual_weight(float p, int i, const Residual& res, int* at) {
    double q = 0.0;
    if (res.len == 0) {
        q = i == res.exclude ? 1.0 : 0.0;
    } else {
        while (*at < res.len && (int)res.ids[*at] < i) ++*at;
        if (*at < res.len && (int)res.ids[*at] == i) q = (double)res.probs[*at];
    }
    const double diff = (double)p - q;
    return diff > 0.0 ? diff : 0.0;
}

// A token's probability as the host stores it: its weight over the weights' sum (`scale`:
// one over it), rounded to f32; where a draft was rejected and its residual has mass, its
// share of the residual over the residual's total, rounded again (verify.rs's `residual`,
// then `from_sorted_weights`).
__device__ __forceinline__ float probability(float w, int i, double scale, const Residual& res,
                                             int* at) {
    const float p = (float)((double)w * scale);
    if (res.rest <= 0.0) return p;
    return (float)(residual_weight(p, i, res, at) / res.rest);
}

// The draw left to the host, which draws from the row itself.
__device__ void leave_to_host(float* out) {
    out[0] = __int_as_float(-1);
    out[1] = 0.0f;
    out[2] = 0.0f;
}

// A row's weights as the host's sampler weighs them, for this thread's run of ids (r) and
// the top-k and top-p cuts (find_cuts): their sum over the row (each run's, then the runs'
// by a fixed tree), or -1, the whole block agreeing, where the host must take the row (no
// usable logit, or an infinite one).
__device__ double weigh(const float* x, int n, float temperature, float min_p, int top_k,
                        float top_p, DrawRow* r, Cut* cuts, int* starts, DrawShared* s) {
    const int t = threadIdx.x;
    const float neg_inf = __int_as_float(0xff800000), inf = __int_as_float(0x7f800000);
    float local = neg_inf;
    for (int i = t; i < n; i += GREEDY_THREADS) local = fmaxf(local, x[i]);  // NaN loses
    const float top = block_reduce<GREEDY_THREADS>(local, s->scratch, true);
    if (top == neg_inf || top == inf) return -1.0;
    const int run = (n + GREEDY_THREADS - 1) / GREEDY_THREADS;
    *r = {x, top, temperature, min_p, min(n, t * run), 0};
    r->end = min(n, r->begin + run);
    find_cuts(*r, top_k, top_p, cuts, starts, s);
    double mine = 0.0;
    walk(*r, cuts, starts, [&](int, float w) { mine += (double)w; });
    return block_sum<GREEDY_THREADS>(mine, s->scratch64);
}

// A token drawn from one row of n logits, as the host's sampler draws it (sampling.rs:
// `process_logits` at `temperature`, `min_p`, `top_k` (0: none) and `top_p`, then
// `Distribution::sample_at(uniform)`; with `exclude` >= 0, from the residual after that
// draft, as verify.rs's `draw_correction`, its distribution the `q_len` entries of `q_ids`
// and `q_probs` (none: a point mass on it)): weights exp((x - max) / temperature), 0
// for non-finite logits, below f32's normal range or under min_p (the largest weighs 1);
// the top-k cut, then the top-p cut (find_cuts); probabilities (`probability`); the first
// token whose running sum of probabilities, in id order, passes uniform times their total.
// Each thread takes a run of ids, so a running sum is its run's total after the runs
// before it, and top-p's sums are counted in fixed point: both round otherwise than the
// host's, which moves an edge by rounding alone. Writes {token's bits, its probability, the
// excluded token's probability before it was excluded (0: none)}, or {-1, 0, 0} where the
// host must draw from the row itself (no usable logit, or an infinite one). One block of
// GREEDY_THREADS (its launch bound keeps it within 64 registers a thread, which a block of
// 1024 needs); engine/tests/draw_kernel.rs runs these steps on the host against the sampler.
extern "C" __global__ void __launch_bounds__(GREEDY_THREADS)
    duet_draw(const float* x, int n, float temperature, float min_p, int top_k, float top_p,
              double uniform, int exclude, const u32* q_ids, const float* q_probs, int q_len,
              float* out) {
    __shared__ DrawShared s;
    __shared__ double sums[GREEDY_THREADS + 1];
    __shared__ int chosen;
    __shared__ float excluded;
    const int t = threadIdx.x;
    DrawRow r;
    Cut cuts[2] = {{0.0f, 0}, {0.0f, 0}};
    int starts[2] = {0, 0};
    if (t == 0) excluded = 0.0f;
    const double total = weigh(x, n, temperature, min_p, top_k, top_p, &r, cuts, starts, &s);
    if (total < 0.0) {
        if (t == 0) leave_to_host(out);
        return;
    }
    const double scale = 1.0 / total;
    Residual res = {exclude, q_ids, q_probs, q_len, 0.0};
    // Every walk over the thread's ids starts from the first entry of the draft's
    // distribution at or after its run.
    const int first = entry_from(res, r.begin);
    int at = first;
    double mine = 0.0;
    if (exclude >= 0) {
        walk(r, cuts, starts, [&](int i, float w) {
            const float p = probability(w, i, scale, res, &at);
            if (i == exclude) excluded = p;
            mine += residual_weight(p, i, res, &at);
        });
        res.rest = block_sum<GREEDY_THREADS>(mine, s.scratch64);
    }
    // The probabilities' sums before each run.
    mine = 0.0;
    at = first;
    walk(r, cuts, starts,
         [&](int i, float w) { mine += (double)probability(w, i, scale, res, &at); });
    if (t == 0) chosen = -1;
    runs_before(mine, sums);
    const double target = uniform * sums[GREEDY_THREADS];
    // The last run with mass that starts at or below the target.
    if (mine > 0.0 && sums[t] <= target) atomicMax(&chosen, t);
    __syncthreads();
    if (chosen < 0 && t == 0) leave_to_host(out);  // no mass left: the host says why
    if (t != chosen) return;
    double running = sums[t];
    int token = -1;
    float drawn = 0.0f;
    int ranks[2] = {starts[0], starts[1]};
    at = first;
    // The walk that stops where the running sum passes the target.
    for (int i = r.begin; i < r.end; ++i) {
        const float p = probability(weight(r, i, cuts, ranks), i, scale, res, &at);
        if (p <= 0.0f) continue;
        // Rounding may leave the run's end short of the target: its last token then.
        token = i;
        drawn = p;
        running += (double)p;
        if (target < running) break;
    }
    out[0] = __int_as_float(token);
    out[1] = drawn;
    out[2] = excluded;
}

// A draft model's proposal from one row of n logits, as sampling.rs's
// `proposal_distribution` makes it: the row's weights as duet_draw weighs them (`weigh`),
// then `without_tail`'s floor: of 1e-4, 1e-6 and 1e-8 of the weights' sum, the highest under
// which the weights add up to at most `tail` of it; the weights above it written in id order
// to `ids` and `weights` (the host normalizes them as it normalizes its own). out[0]: how
// many (bits), or -1 where the host must make it from the row (no usable logit or an
// infinite one, no floor leaving out so little, every token kept, or more than `cap`).
extern "C" __global__ void __launch_bounds__(GREEDY_THREADS)
    duet_propose(const float* x, int n, float temperature, float min_p, int top_k, float top_p,
                 double tail, u32* ids, float* weights, int cap, float* out) {
    __shared__ DrawShared s;
    __shared__ int before[GREEDY_THREADS + 1];
    const int t = threadIdx.x;
    DrawRow r;
    Cut cuts[2] = {{0.0f, 0}, {0.0f, 0}};
    int starts[2] = {0, 0};
    const double total = weigh(x, n, temperature, min_p, top_k, top_p, &r, cuts, starts, &s);
    if (total < 0.0) {
        if (t == 0) leave_to_host(out);
        return;
    }
    const double shares[3] = {1e-4, 1e-6, 1e-8};
    float least = -1.0f;
    for (int k = 0; k < 3 && least < 0.0f; ++k) {
        const float at_least = (float)(shares[k] * total);
        double kept = 0.0;
        walk(r, cuts, starts, [&](int, float w) {
            if (w > at_least) kept += (double)w;
        });
        if (total - block_sum<GREEDY_THREADS>(kept, s.scratch64) <= tail * total) least = at_least;
    }
    int count = 0;
    if (least >= 0.0f) walk(r, cuts, starts, [&](int, float w) { count += w > least; });
    runs_before(count, before);
    const int kept = before[GREEDY_THREADS];
    if (least < 0.0f || kept == n || kept > cap) {
        if (t == 0) leave_to_host(out);
        return;
    }
    int at = before[t];
    walk(r, cuts, starts, [&](int i, float w) {
        if (w > least) {
            ids[at] = (u32)i;
            weights[at++] = w;
        }
    });
    if (t == 0) {
        out[0] = __int_as_float(kept);
        out[1] = 0.0f;
        out[2] = 0.0f;
    }
}

// LoRA adapters (lora.rs): a row's adapter is a table of its deltas (`Adapter::step_table`),
// 7 entries a layer in the projections' order (q, k, v, o, gate, up, down); a row without
// one has 0 for its table in the step's inputs.
struct LoraDelta {
    u64 a;  // rank x k bf16 (0: the adapter leaves the projection as it is)
    u64 b;  // B^T: rank x n bf16
    int rank;
    float scale;
};

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

// The delta of projection `module` in `layer` for the row's adapter, or null.
__device__ __forceinline__ const LoraDelta* lora_delta(const u64* adapters, int row, int layer,
                                                       int module) {
    const u64 table = adapters[row];
    if (table == 0) return nullptr;
    const LoraDelta* d = (const LoraDelta*)table + layer * 7 + module;
    return d->a == 0 ? nullptr : d;
}

// A LoRA delta's first half for the projections `first`.. of one input (blockIdx.y the
// projection): t = scale * x A^T for each row of an adapter, x the projections' Q8_1 input
// (each block's scale times its integers). Grid (rows, projections, z); block z takes
// ranks z, z + gridDim.z, ... in turn, its threads eight of the row's values at a time in
// order, then the block's fixed sum. t: [rows, 3, LORA_MAX_RANK] f32.
extern "C" __global__ void duet_lora_shrink(const unsigned char* x, int k, int row_blocks,
                                            const u64* adapters, int layer, int first,
                                            float* t) {
    __shared__ float scratch[LORA_THREADS / 32];
    const int row = blockIdx.x, m = blockIdx.y;
    const LoraDelta* d = lora_delta(adapters, row, layer, first + m);
    if (d == nullptr) return;
    const unsigned char* xr = x + (u64)row * row_blocks * Q8_1_BYTES;
    for (int r = blockIdx.z; r < d->rank; r += gridDim.z) {
        const u16* a = (const u16*)d->a + (u64)r * k;
        float sum = 0.0f;
        for (int c = threadIdx.x; c < k / 8; c += LORA_THREADS) {
            const unsigned char* block = xr + (u64)(c / 4) * Q8_1_BYTES;
            const float scale = f16_to_f32(*(const u16*)block);
            const signed char* q = (const signed char*)block + 4 + (c % 4) * 8;
            for (int i = 0; i < 8; ++i) {
                sum = fmaf(bf16_to_f32(a[c * 8 + i]), scale * (float)q[i], sum);
            }
        }
        const float total = block_sum<LORA_THREADS>(sum, scratch);
        if (threadIdx.x == 0) t[((u64)row * 3 + m) * LORA_MAX_RANK + r] = total * d->scale;
    }
}

// Its second half: y += t B^T for each row of an adapter, over the outputs of `modules`
// projections (from `first`) one after another: projection i's n_i values of row r at
// y_i + r * s_i (one launch may have computed them side by side). Grid (ceil(sum n_i /
// LORA_THREADS), rows), a thread an output, its sum over the ranks in order.
extern "C" __global__ void duet_lora_expand(const float* t, const u64* adapters, int layer,
                                            int first, int modules, float* y0, int n0,
                                            int s0, float* y1, int n1, int s1, float* y2,
                                            int n2, int s2) {
    const int row = blockIdx.y;
    int o = blockIdx.x * LORA_THREADS + threadIdx.x, m = 0, n = n0, s = s0;
    float* y = y0;
    if (o >= n0 && modules > 1) {
        o -= n0, m = 1, n = n1, s = s1, y = y1;
        if (o >= n1 && modules > 2) o -= n1, m = 2, n = n2, s = s2, y = y2;
    }
    if (o >= n) return;
    const LoraDelta* d = lora_delta(adapters, row, layer, first + m);
    if (d == nullptr) return;
    const float* tr = t + ((u64)row * 3 + m) * LORA_MAX_RANK;
    const u16* b = (const u16*)d->b;
    float sum = 0.0f;
    for (int r = 0; r < d->rank; ++r) sum = fmaf(tr[r], bf16_to_f32(b[(u64)r * n + o]), sum);
    y[(u64)row * s + o] += sum;
}
